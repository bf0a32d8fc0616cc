"""Where the project keeps files it generates outside git."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def tiny_model_dir() -> Path:
    """The generated tiny Qwen3-Next checkpoint (``SERVE_APP_MODEL_DIR`` overrides the default)."""
    override = os.environ.get("SERVE_APP_MODEL_DIR")
    return Path(override) if override else REPO_ROOT / ".models" / "tiny-qwen3-next"


def tiny_embedding_model_dir() -> Path:
    """The generated tiny Qwen3 embedding checkpoint (``SERVE_APP_EMBEDDING_MODEL_DIR`` overrides)."""
    override = os.environ.get("SERVE_APP_EMBEDDING_MODEL_DIR")
    return Path(override) if override else REPO_ROOT / ".models" / "tiny-qwen3-embedding"


def state_dir() -> Path:
    """Local-only generated state: the dev key store and signing keys (``SERVE_APP_STATE_DIR``
    overrides). Regions never use it; their auth files are named explicitly in their config."""
    override = os.environ.get("SERVE_APP_STATE_DIR")
    return Path(override) if override else REPO_ROOT / ".state"
