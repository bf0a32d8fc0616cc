"""The engine preflight refuses torchvision & co. next to torch+cpu, and only there (GPU images
ship them with a CUDA torch, and CUDA vLLM needs torchvision)."""

import pytest

from serve_app.engine.preflight import EngineEnvironmentError, check_engine_environment, installed_torch_version


def _everything_installed(name):
    return object()


def _nothing_installed(name):
    return None


def test_torch_cpu_with_torchvision_fails_with_the_fix_in_the_message():
    with pytest.raises(EngineEnvironmentError) as err:
        check_engine_environment("2.13.0+cpu", _everything_installed)
    assert "torchvision, torchaudio, torchcodec" in str(err.value)
    assert "pip uninstall -y torchvision torchaudio torchcodec" in str(err.value)


def test_torch_cpu_alone_passes():
    check_engine_environment("2.13.0+cpu", _nothing_installed)


@pytest.mark.parametrize("cuda_torch", ["2.9.1", "2.9.1+cu128", "2.14.1+cu130"])
def test_a_cuda_environment_passes_with_torchvision_and_co_installed(cuda_torch):
    check_engine_environment(cuda_torch, _everything_installed)


def test_this_machines_engine_environment_passes():
    """The venv scripts/install.py builds: torch+cpu, and none of the three."""
    assert (installed_torch_version() or "").endswith("+cpu")
    check_engine_environment()
