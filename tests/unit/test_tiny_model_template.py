"""The generated tiny model: chat template rendering, tokens, determinism (no Ray/vLLM)."""

import hashlib
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from serve_app.devtools.tiny_model import GENERATOR_VERSION, STAMP_FILE, ensure_tiny_model

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_files_and_stamp(model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (model_dir / name).is_file(), name
    assert (model_dir / STAMP_FILE).read_text().strip() == GENERATOR_VERSION
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_next"
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["max_position_embeddings"] >= 8192
    assert config["vocab_size"] % 64 == 0
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert "temperature" not in generation and "top_p" not in generation


def test_special_and_markup_tokens_are_single_tokens(tokenizer):
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    markup = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    markup += ["<tool_response>", "</tool_response>"]
    for token in special + markup:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids) == [token], token
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    # Markup is not special: it survives skip_special_tokens, as in Qwen's tokenizer.
    ids = tokenizer.encode("<|im_start|><think>x</think><tool_call><|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think><tool_call>"


def test_system_and_user_chatml(tokenizer):
    text = render(
        tokenizer,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_enable_thinking(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    off = render(tokenizer, messages, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for kwargs in ({}, {"enable_thinking": True}):
        on = render(tokenizer, messages, add_generation_prompt=True, **kwargs)
        assert on.endswith("<|im_start|>assistant\n") and "<think>" not in on
    assert not render(tokenizer, messages).endswith("assistant\n")


def test_tools_listed_in_system_block(tokenizer):
    text = render(
        tokenizer,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL],
        add_generation_prompt=True,
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    tools_block = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(tools_block) == WEATHER_TOOL
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in text
    assert text.count("<|im_start|>system") == 1


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}])
def test_assistant_tool_calls_and_grouped_tool_responses(tokenizer, arguments):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": i, **call} for i in "ab"]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rainy"},
    ]
    text = render(tokenizer, messages, tools=[WEATHER_TOOL], add_generation_prompt=True)
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{block}\n{block}<|im_end|>\n" in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrainy\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_reasoning_rendered_as_think_block(tokenizer):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
    ]
    text = render(tokenizer, messages)
    assert text.endswith("<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4<|im_end|>\n")
    # `reasoning` (vLLM's field name) works too; thinking before the last query is dropped.
    messages[1] = {"role": "assistant", "content": "4", "reasoning": "Add them."}
    assert render(tokenizer, messages) == text
    later = render(tokenizer, messages + [{"role": "user", "content": "And 3+3?"}])
    assert "Add them." not in later and "<|im_start|>assistant\n4<|im_end|>" in later


def test_idempotent_and_deterministic(model_dir, tmp_path):
    stamp_mtime = (model_dir / STAMP_FILE).stat().st_mtime_ns
    assert ensure_tiny_model(model_dir) == model_dir
    assert (model_dir / STAMP_FILE).stat().st_mtime_ns == stamp_mtime  # not rebuilt
    again = ensure_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha256(again / name) == sha256(model_dir / name), name
    leftovers = [p.name for p in tmp_path.iterdir() if p.name not in ("again", ".again.lock")]
    assert not leftovers  # no temp dirs left behind


def test_another_seed_is_the_same_model_with_other_weights(model_dir, tmp_path):
    """What the fault suite deploys as a weights upgrade (serve_app/faults/redeploy.py)."""
    other = ensure_tiny_model(tmp_path / "seed1", seed=1)
    for name in ("tokenizer.json", "config.json"):
        assert sha256(other / name) == sha256(model_dir / name), name
    assert sha256(other / "model.safetensors") != sha256(model_dir / "model.safetensors")
    assert (other / STAMP_FILE).read_text().strip() == f"{GENERATOR_VERSION}+seed1"
    assert (model_dir / STAMP_FILE).read_text().strip() == GENERATOR_VERSION  # seed 0's stamp as before


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


def test_output_prior_makes_json_cheap(model, tokenizer):
    """Random weights still rank string/structure closers first and whitespace last."""
    import torch

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "JSON please"}],
        add_generation_prompt=True,
        enable_thinking=False,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        logits = model(**ids).logits[0, -1].float()
    quote = tokenizer.convert_tokens_to_ids('"')
    space = tokenizer.convert_tokens_to_ids("Ġ")  # byte-level BPE's space
    assert logits.argmax().item() in {
        i for i in range(len(tokenizer)) if '"' in tokenizer.decode([i])
    }
    assert logits[quote] - logits[space] > 10


def _prompt(tokenizer, **kwargs):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi in one short sentence."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True, **kwargs,
    )


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_greedy_turn_ends_after_the_quote_chain(model, tokenizer, enable_thinking):
    """Greedy text walks the quote tokens in order and then ends its turn: a few tokens, not 8192."""
    from serve_app.devtools.tiny_model import _quote_chain_tokens

    prompt = _prompt(tokenizer, enable_thinking=enable_thinking)
    out = model.generate(**prompt, max_new_tokens=64, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert out[-1].item() == end and (out == end).sum().item() == 1
    chain = _quote_chain_tokens(tokenizer)
    walked = out[:-1].tolist()
    assert walked and all(t in chain for t in walked)
    assert walked == chain[chain.index(walked[0]):]  # consecutive links, up to the last one


def test_sampled_turns_end_within_a_modest_length_and_never_empty(model, tokenizer):
    import torch

    prompt = _prompt(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    lengths = []
    for seed in range(12):
        torch.manual_seed(seed)
        out = model.generate(**prompt, max_new_tokens=300, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        generated = out[0, prompt["input_ids"].shape[1]:].tolist()
        assert end in generated, f"seed {seed} ran to the cap"
        lengths.append(generated.index(end))
    assert min(lengths) >= 1  # the first token after the prompt's newline is never the end
    assert len(set(lengths)) > 3  # seeded, not one fixed length
