"""The model catalog: the one place that states model facts (ids, aliases, weights, caps, parsers).

Serve configs name catalog ids; the router resolves what callers send (canonical id, alias or
Hugging Face repo id) through this module; engine settings start from here and a config may
override them per deployment (the CPU default swaps in the tiny local checkpoint and the Hermes
parser that its chat template speaks).

A model's ``task`` says which API surfaces it serves (``serve_app/surfaces``: each row names the
task it needs): ``generate`` models answer chat, completions, Responses and Messages; ``embed``
models answer ``/v1/embeddings``, on vLLM's pooling runner. Both tokenize.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineDefaults(BaseModel):
    """vLLM engine settings that are facts about the model in production."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_model_len: int = Field(gt=0, description="Served context cap (prompt + completion).")
    enforce_eager: bool = Field(description="Skip CUDA graphs.")
    dtype: str = "auto"
    quantization: str | None = Field(
        None, description="None lets vLLM read the checkpoint's own quantization_config."
    )
    tool_call_parser: str | None = None
    tool_strict_level: str | None = Field(
        None, description="vLLM's floor for tool-call constraints: auto, function or parameter."
    )
    reasoning_parser: str | None = None
    runner: Literal["generate", "pooling"] | None = Field(
        None, description="vLLM's --runner: pooling for an embedding model; None lets vLLM choose (generate)."
    )
    hf_overrides: dict[str, Any] | None = Field(
        None, description="vLLM's --hf-overrides: config facts the checkpoint's config.json does not state."
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "priority",
        description="'priority': the engine schedules waiting requests by the priority the router "
        "sets from the key's tier (an interactive tier ahead of a batch one), then by arrival.",
    )


GIB = 2**30


class GpuMemory(BaseModel):
    """What one replica of the model needs of a GPU's memory, for the arithmetic of a GPU that two
    engines share (``serve_app/regions/gpu_memory.py``, docs/regions.md "One GPU, two engines").

    From the checkpoint's config: the weights as loaded, and the KV cache of one token (every
    full-attention layer's K and V at the served dtype) and of one sequence's fixed state
    (Gated-DeltaNet layers keep a recurrent state per sequence, whatever its length). The
    headroom is an allowance, not a measurement: vLLM's profiled peak activations at
    ``max_num_batched_tokens``, its sampler, and the CUDA context and allocator slack."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weights_gib: float = Field(gt=0)
    kv_bytes_per_token: int = Field(gt=0)
    state_bytes_per_sequence: int = Field(0, ge=0)
    headroom_gib: float = Field(gt=0)


class CatalogModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="Canonical id callers use at every inference endpoint.")
    task: Literal["generate", "embed"] = Field(
        "generate", description="generate: chat, completions, Responses, Messages; embed: /v1/embeddings."
    )
    hf_repo: str = Field(description="The exact production checkpoint.")
    aliases: tuple[str, ...] = ()
    description: str
    weights_precision: str
    native_context: int
    thinking_by_default: bool = Field(
        False, description="Qwen3 thinks unless told not to; this product turns it off."
    )
    engine: EngineDefaults
    default_max_tokens: int | None = Field(
        None,
        gt=0,
        description="The completion limit the router sets on a request that sets none (and charges "
        "for it: serve_app/router/pricing.py); never above engine.max_model_len. A generating model's "
        "fact; an embedding model generates nothing.",
    )
    embedding_dimensions: int | None = Field(
        None, gt=0, description="An embedding model's vector size (a request's `dimensions` may lower it)."
    )
    gpu_memory: GpuMemory | None = Field(
        None, description="Stated for a model that may share a GPU with another engine (regions)."
    )
    speculative_method: Literal["mtp"] | None = Field(
        None,
        description="The speculative-decoding method vLLM offers with this checkpoint alone: 'mtp' "
        "drafts with the model's own multi-token-prediction layers (no draft model). Off unless a "
        "region opts in.",
    )

    @model_validator(mode="after")
    def _facts_of_its_task(self) -> "CatalogModel":
        if self.task == "generate" and self.default_max_tokens is None:
            raise ValueError("a generating model needs default_max_tokens")
        if self.task == "embed" and (self.default_max_tokens is not None or self.engine.runner != "pooling"):
            raise ValueError("an embedding model runs on vLLM's pooling runner and has no completion limit")
        if (self.embedding_dimensions is not None) != (self.task == "embed"):
            raise ValueError("embedding_dimensions is an embedding model's fact, and it needs one")
        return self

    @model_validator(mode="after")
    def _default_fits_the_context(self) -> "CatalogModel":
        if self.default_max_tokens is not None and self.default_max_tokens > self.engine.max_model_len:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) is over max_model_len ({self.engine.max_model_len})"
            )
        return self

    @property
    def accepted_names(self) -> tuple[str, ...]:
        """Every name that resolves to this model: the id, its aliases and its repo id."""
        return (self.id, *self.aliases, self.hf_repo)


QWEN36_35B_A3B = CatalogModel(
    id="qwen-3.6-35b-a3b",
    hf_repo="Qwen/Qwen3.6-35B-A3B-FP8",
    aliases=("qwen-3.6-a3b",),
    description="Qwen3.6 35B-A3B MoE (256 experts, 8 routed + 1 shared; ~3B active), native FP8",
    weights_precision="fp8",
    native_context=262_144,
    engine=EngineDefaults(
        # Served cap: bounds KV-cache VRAM on one GPU (model card, "Context window").
        max_model_len=8192,
        # Works around a CUDA-graph path on the Gated-DeltaNet hybrid attention (model card).
        enforce_eager=True,
        # Qwen3.5/3.6 chat templates emit XML tool calls (<tool_call><function=...>), which is
        # what vLLM's qwen3_coder parser reads; Hermes JSON would not parse them. vLLM recipe
        # "Qwen3.5 & Qwen3.6": --reasoning-parser qwen3.
        tool_call_parser="qwen3_coder",
        # Every tool call's arguments are decoded against the tool's JSON schema, as if each tool
        # were `strict: true`: under tool_choice required/named vLLM's default ("auto") only
        # constrains the envelope, and arguments can come back as any JSON value.
        tool_strict_level="parameter",
        reasoning_parser="qwen3",
    ),
    # Half the served context: an answer of up to ~3,000 words (thinking included, when a request
    # opts in) still leaves 4,096 tokens for the prompt, and every request without a limit is
    # charged and escrowed this much, not the whole 8,192 (a free key's 40,000 tokens/min still
    # fits 9 of them). vLLM alone would allow the whole context left after the prompt.
    default_max_tokens=4096,
    # Its text config (40 layers: 30 Gated-DeltaNet, 10 full attention with 2 KV heads of 256):
    # KV per token 10 layers x 2 (K, V) x 2 heads x 256 x 2 bytes (bf16 cache); per sequence the
    # Gated-DeltaNet state, 30 layers x 32 value heads x 128 x 128 x 4 bytes (fp32) plus the
    # convolution state, 30 x 3 x 8192 x 2 bytes. Weights: the FP8 checkpoint with its bf16
    # embeddings, norms and MTP layer, ~35 GB (counted as 35 GiB).
    gpu_memory=GpuMemory(
        weights_gib=35,
        kv_bytes_per_token=10 * 2 * 2 * 256 * 2,
        state_bytes_per_sequence=30 * (32 * 128 * 128 * 4 + 3 * 8192 * 2),
        headroom_gib=6,
    ),
    # vLLM maps the qwen3_5_moe checkpoint's MTP layers to its Qwen3_5MoeMTP drafter; in 0.32 the
    # method is spelled "mtp" (per-model names such as "qwen3_5_mtp" are deprecated aliases).
    speculative_method="mtp",
)

QWEN35_27B = CatalogModel(
    id="qwen-3.5-27b",
    hf_repo="Qwen/Qwen3.5-27B-FP8",
    aliases=("qwen-3.5-27b-fp8",),
    description="Qwen3.5 27B dense sibling, native FP8",
    weights_precision="fp8",
    native_context=262_144,
    engine=EngineDefaults(
        max_model_len=8192,
        enforce_eager=True,  # same Gated-DeltaNet CUDA-graph workaround (model card)
        tool_call_parser="qwen3_coder",
        tool_strict_level="parameter",
        reasoning_parser="qwen3",
    ),
    default_max_tokens=4096,  # as the 35B-A3B's, for the same reasons
    speculative_method="mtp",  # dense qwen3_5: vLLM's Qwen3_5MTP drafter
)

QWEN3_EMBEDDING_06B = CatalogModel(
    id="qwen-3-embedding-0.6b",
    hf_repo="Qwen/Qwen3-Embedding-0.6B",
    aliases=("qwen3-embedding-0.6b",),
    task="embed",
    description="Qwen3-Embedding 0.6B: text embeddings for retrieval, co-located with the LLM on its GPU",
    weights_precision="bf16",
    native_context=32_768,
    embedding_dimensions=1024,
    engine=EngineDefaults(
        # OpenAI's own cap per input (8192 tokens), well inside the model's native 32K: a longer
        # input is a 400 from the engine, not a silent truncation.
        max_model_len=8192,
        # Every input is one prefill and no decode: CUDA graphs would buy little, and what their
        # capture takes would come out of the small budget it has beside the LLM (regions).
        enforce_eager=True,
        runner="pooling",
        # Trained with Matryoshka representation learning (model card: any output size from 32
        # to 1024); vLLM honours `dimensions` only for a model it knows to be Matryoshka.
        hf_overrides={"is_matryoshka": True},
    ),
    # Qwen3-0.6B's config: 28 layers with 8 KV heads of 128; bf16 weights, 1.19 GB (counted as
    # 1.2 GiB). Last-token
    # pooling (its sentence-transformers files) finishes each input in its prefill, so the KV
    # cache it needs is one engine step's tokens, freed when the step ends.
    gpu_memory=GpuMemory(
        weights_gib=1.2,
        kv_bytes_per_token=28 * 2 * 8 * 128 * 2,
        headroom_gib=1.5,
    ),
)

CATALOG: dict[str, CatalogModel] = {m.id: m for m in (QWEN36_35B_A3B, QWEN35_27B, QWEN3_EMBEDDING_06B)}


def _build_name_index() -> dict[str, str]:
    index: dict[str, str] = {}
    for model in CATALOG.values():
        for name in model.accepted_names:
            if name.lower() in index:
                raise ValueError(f"catalog name {name!r} is claimed twice")
            index[name.lower()] = model.id
    return index


# Names compare case-insensitively: "Qwen/Qwen3.6-35B-A3B-FP8" and its lower-case spelling are
# the same checkpoint to a caller.
_NAME_INDEX = _build_name_index()


def canonical_id(name: str) -> str | None:
    """The canonical id that ``name`` (id, alias or HF repo id) resolves to, or None."""
    return _NAME_INDEX.get(name.strip().lower())


def get(model_id: str) -> CatalogModel:
    """The catalog entry for a canonical id; KeyError names the known ids."""
    try:
        return CATALOG[model_id]
    except KeyError:
        raise KeyError(f"{model_id!r} is not in the catalog (known: {', '.join(CATALOG)})") from None


def speculative_config(model: CatalogModel, num_speculative_tokens: int) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for the model's own method; ValueError if it has none."""
    if model.speculative_method is None:
        raise ValueError(f"{model.id} has no speculative-decoding method vLLM can run from its checkpoint")
    return {"method": model.speculative_method, "num_speculative_tokens": num_speculative_tokens}
