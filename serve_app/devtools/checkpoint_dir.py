"""Build a generated checkpoint directory once, atomically: the tiny stand-in models
(``tiny_model``, ``tiny_embedding_model``) share it.

A stamp file naming the generator's version is written last, and the whole directory is renamed
into place only once it is complete, so a reader never sees half a checkpoint and a version bump
rebuilds an old one. Several processes (test workers, replicas) may ask at once: one builds,
the rest wait on a lock beside the directory.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

STAMP_FILE = ".serve_app_tiny_model"


def is_complete(out_dir: Path, version: str) -> bool:
    """Whether ``out_dir`` holds a finished checkpoint from generator ``version``."""
    stamp = out_dir / STAMP_FILE
    return stamp.is_file() and stamp.read_text().strip() == version


def ensure_built(out_dir: Path, version: str, write: Callable[[Path], None], *, force: bool = False) -> Path:
    """``out_dir`` as ``write(directory)`` fills it, unless a complete one of ``version`` is there."""
    if not force and is_complete(out_dir, version):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if force or not is_complete(out_dir, version):
            _build_into(out_dir, version, write)
    return out_dir


def _build_into(out_dir: Path, version: str, write: Callable[[Path], None]) -> None:
    # Build beside the target (same filesystem) so the final rename is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write(tmp)
        # mkdtemp makes the directory private; a served model must be readable by workers.
        for path in (tmp, *tmp.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        (tmp / STAMP_FILE).write_text(version + "\n")  # last: marks completeness
        if out_dir.exists():
            # An old or partial model: move it aside first, then drop it after the swap.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            os.replace(out_dir, old / "model")
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
