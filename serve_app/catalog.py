"""The model catalog: the one place that states model facts (ids, aliases, weights, caps, parsers).

Serve configs name catalog ids; the router resolves what callers send (canonical id, alias or
Hugging Face repo id) through this module; engine settings start from here and a config may
override them per deployment (the CPU default swaps in the tiny local checkpoint and the Hermes
parser that its chat template speaks).
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
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "priority",
        description="'priority': the engine schedules waiting requests by the priority the router "
        "sets from the key's tier (an interactive tier ahead of a batch one), then by arrival.",
    )


class CatalogModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="Canonical id callers use at every inference endpoint.")
    hf_repo: str = Field(description="The exact production checkpoint.")
    aliases: tuple[str, ...] = ()
    description: str
    weights_precision: str
    native_context: int
    thinking_by_default: bool = Field(
        False, description="Qwen3 thinks unless told not to; this product turns it off."
    )
    engine: EngineDefaults
    default_max_tokens: int = Field(
        gt=0,
        description="The completion limit the router sets on a request that sets none (and charges "
        "for it: serve_app/router/pricing.py); never above engine.max_model_len.",
    )
    speculative_method: Literal["mtp"] | None = Field(
        None,
        description="The speculative-decoding method vLLM offers with this checkpoint alone: 'mtp' "
        "drafts with the model's own multi-token-prediction layers (no draft model). Off unless a "
        "region opts in.",
    )

    @model_validator(mode="after")
    def _default_fits_the_context(self) -> "CatalogModel":
        if self.default_max_tokens > self.engine.max_model_len:
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

CATALOG: dict[str, CatalogModel] = {m.id: m for m in (QWEN36_35B_A3B, QWEN35_27B)}


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
