import pytest

from serve_app import catalog


@pytest.mark.parametrize(
    "name",
    ["qwen-3.6-35b-a3b", "qwen-3.6-a3b", "Qwen/Qwen3.6-35B-A3B-FP8", "qwen/qwen3.6-35b-a3b-fp8", " qwen-3.6-a3b "],
)
def test_model_card_names_resolve_to_the_canonical_id(name):
    assert catalog.canonical_id(name) == "qwen-3.6-35b-a3b"


@pytest.mark.parametrize("name", ["gpt-4o", "qwen-3.6", "", "Qwen/Qwen3.6-35B-A3B"])
def test_unknown_names_do_not_resolve(name):
    assert catalog.canonical_id(name) is None


def test_sibling_resolves_to_itself():
    assert catalog.canonical_id("qwen-3.5-27b") == "qwen-3.5-27b"


def test_production_entry_matches_the_model_card():
    entry = catalog.get("qwen-3.6-35b-a3b")
    assert entry.hf_repo == "Qwen/Qwen3.6-35B-A3B-FP8"
    assert entry.weights_precision == "fp8"
    assert entry.engine.max_model_len == 8192
    assert entry.engine.enforce_eager is True
    assert entry.thinking_by_default is False
    assert entry.engine.reasoning_parser == "qwen3"
    assert entry.engine.tool_call_parser == "qwen3_coder"
    assert entry.default_max_tokens == 4096


def test_a_default_completion_limit_over_the_context_is_refused():
    entry = catalog.get("qwen-3.6-35b-a3b")
    with pytest.raises(ValueError, match="default_max_tokens"):
        catalog.CatalogModel.model_validate({**entry.model_dump(), "default_max_tokens": 8193})


def test_unknown_id_error_names_the_known_ids():
    with pytest.raises(KeyError, match="qwen-3.6-35b-a3b"):
        catalog.get("nope")


def test_no_name_is_claimed_twice():
    names = [n.lower() for m in catalog.CATALOG.values() for n in m.accepted_names]
    assert len(names) == len(set(names))
