"""The request router's parts without Serve: the prompt's block chain, the bounded index of what
each replica holds, the session key's precedence, and the policy's corner cases."""

import pytest

from serve_app.routing import decisions, policy, session
from serve_app.routing.index import PrefixIndex
from serve_app.routing.prompt import prompt_blocks

SYSTEM = "You are terse. " * 100


def body(*turns: str, system: str = SYSTEM, tools=None) -> dict:
    messages = [{"role": "system", "content": system}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return {"model": "m", "messages": messages, **({"tools": tools} if tools else {})}


# --- the block chain -----------------------------------------------------------------------------
def test_the_next_turn_repeats_every_whole_block_of_the_last_one():
    one = prompt_blocks(body("Fix it."), "s")
    two = prompt_blocks(body("Fix it.", "Fixed.", "Now test it."), "s")
    assert one.hashes and two.hashes[:len(one.hashes)] == one.hashes
    assert len(two.hashes) == two.chars // 256


@pytest.mark.parametrize("change", [
    dict(salt="another owner"),
    dict(system="You are verbose. " * 100),
    dict(tools=[{"type": "function", "function": {"name": "grep"}}]),
])
def test_another_owner_system_prompt_or_tool_schema_shares_no_block(change):
    salt = change.pop("salt", "s")
    base, other = prompt_blocks(body("Fix it."), "s"), prompt_blocks(body("Fix it.", **change), salt)
    assert base.hashes[0] != other.hashes[0]


def test_responses_items_and_completions_prompts_chain_too():
    items = [{"type": "message", "role": "user", "content": "x" * 600}]
    one = prompt_blocks({"input": items}, None)
    two = prompt_blocks({"input": items + [{"type": "message", "role": "assistant", "content": "y"}]}, None)
    assert one.hashes and two.hashes[:len(one.hashes)] == one.hashes
    short, long = prompt_blocks({"prompt": "a" * 300}, None), prompt_blocks({"prompt": "a" * 600}, None)
    assert long.hashes[:1] == short.hashes


def test_a_prompt_shorter_than_a_block_has_no_block():
    assert prompt_blocks({"prompt": "hi"}, None).hashes == ()


# --- the index -----------------------------------------------------------------------------------
def test_match_is_the_depth_each_replica_holds():
    index = PrefixIndex(blocks_per_replica=100)
    index.sync(["a", "b", "c"])
    index.record("a", [1, 2, 3, 4])
    index.record("b", [1, 2, 9])
    assert index.match([1, 2, 3, 4, 5], ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    assert index.match([7, 1], ["a", "b"]) == {"a": 0, "b": 0}
    assert index.match([1, 2, 3, 4], ["a", "unknown"]) == {"a": 4, "unknown": 0}


def test_a_replica_forgets_a_prompts_tail_first_as_the_engine_does():
    index = PrefixIndex(blocks_per_replica=4)
    index.sync(["a"])
    index.record("a", [1, 2, 3])
    index.record("a", [7, 8])  # 5 blocks for 4: the oldest goes, which is 3 (the first prompt's tail)
    assert index.match([1, 2, 3], ["a"]) == {"a": 2}
    assert index.match([7, 8], ["a"]) == {"a": 2}
    assert index.size("a") == 4


def test_the_index_total_is_shared_by_the_replicas_and_a_gone_replica_frees_its_share():
    index = PrefixIndex(blocks_per_replica=1000, max_blocks=10)
    index.sync(["a", "b"])
    index.record("a", list(range(100)))
    index.record("b", list(range(100, 200)))
    assert index.size("a") == index.size("b") == 5
    index.sync(["b"])
    assert index.size("a") == 0 and index.capacity == 10
    assert index.match([0], ["a"]) == {"a": 0}
    assert len(index._holders) == 5  # nothing of a's left behind
    index.sync(["b", "c", "d"])  # more replicas: each one's share shrinks at once
    assert index.size("b") == 3


def test_a_new_replica_reuses_a_freed_bit_without_inheriting_blocks():
    index = PrefixIndex(blocks_per_replica=10)
    index.sync(["a", "b"])
    index.record("a", [1])
    index.sync(["b"])
    index.sync(["b", "c"])
    assert index.match([1], ["b", "c"]) == {"b": 0, "c": 0}


# --- the session key -----------------------------------------------------------------------------
def test_session_precedence_header_cache_key_response_anthropic_user_then_openai_user():
    full = {"prompt_cache_key": "k", "metadata": {"user_id": "a"}, "user": "u"}
    assert session.session_key({"x-session-id": "h"}, full, "resp_1") == "h:h"
    assert session.session_key({}, full, "resp_1") == "k:k"
    assert session.session_key({}, {**full, "prompt_cache_key": None}, "resp_1") == "r:resp_1"
    assert session.session_key({}, {"metadata": {"user_id": "a"}, "user": "u"}) == "a:a"
    assert session.session_key({}, {"user": "u"}) == "u:u"
    assert session.session_key({}, {"metadata": {"tag": "x"}, "user": ""}) is None


def test_the_responses_chain_is_the_id_the_engine_gives_the_answer():
    assert session.session_key({}, {}, session.response_id("abc")) == session.response_session("resp_abc")


def test_a_huge_key_travels_as_its_digest():
    key = session.session_key({"x-session-id": "x" * 100_000}, {})
    assert key.startswith("h:#") and len(key) < 40


def test_the_comparison_arm_is_deterministic_and_splits_sessions():
    arms = [session.compare_arm(f"h:s{i}") for i in range(200)]
    assert arms == [session.compare_arm(f"h:s{i}") for i in range(200)]
    assert 60 < arms.count("default") < 140
    assert session.compare_arm(None) == "prefix"


# --- the policy ------------------------------------------------------------------------------------
T = policy.Thresholds()


def test_with_every_replica_saturated_the_request_stays_where_its_prefix_is():
    loads = [policy.Load("a", 20, 32), policy.Load("b", 18, 32)]
    chosen = policy.plan(loads, {"a": 10}, 10, T)
    assert (chosen.choice, chosen.reason) == ("a", "prefix")


def test_once_every_replica_is_saturated_a_session_holds_only_within_the_imbalance():
    """Saturated everywhere, the pin's replica still wins a near tie (its history is there), but
    not a queue far longer than another's: until 2026-12-07 it won at any length."""
    near = [policy.Load("a", 20, 32), policy.Load("b", 16, 32)]
    far = [policy.Load("a", 30, 32), policy.Load("b", 16, 32)]  # 14 more: past the imbalance (8)
    assert (policy.plan(near, {}, 5, T, pinned="a").choice, policy.plan(near, {}, 5, T, pinned="a").reason) == (
        "a", "session")
    shed = policy.plan(far, {}, 5, T, pinned="a")
    assert (shed.choice, shed.reason) == ("b", "shed")


def test_an_end_users_id_pins_within_the_imbalance_a_named_conversation_past_it():
    """``user`` is often one value for a whole app: pinned like a prefix (within the imbalance),
    where a session the caller named stays while its replica has room."""
    loads = [policy.Load("a", 12, 32), policy.Load("b", 0, 32)]  # a unsaturated (16), 12 past b
    assert policy.plan(loads, {}, 5, T, pinned="a").choice == "a"
    loose = policy.plan(loads, {}, 5, T, pinned="a", pinned_loosely=True)
    assert (loose.choice, loose.reason) == ("b", "shed")
    within = [policy.Load("a", 6, 32), policy.Load("b", 0, 32)]
    assert policy.plan(within, {}, 5, T, pinned="a", pinned_loosely=True).reason == "session"


def test_an_end_users_pin_gives_way_to_a_known_prefix_a_named_session_does_not():
    loads = [policy.Load("a", 0, 32), policy.Load("b", 0, 32)]
    assert policy.plan(loads, {"b": 10}, 10, T, pinned="a").choice == "a"
    follows = policy.plan(loads, {"b": 10}, 10, T, pinned="a", pinned_loosely=True)
    assert (follows.choice, follows.reason) == ("b", "prefix")


def test_only_an_end_users_id_is_a_loose_session():
    named = [session.session_key({"x-session-id": "s"}, {}), session.session_key({}, {"prompt_cache_key": "k"}),
             session.session_key({}, {}, "resp_1")]
    users = [session.session_key({}, {"user": "app"}), session.session_key({}, {"metadata": {"user_id": "app"}})]
    assert [session.loose(key) for key in named + users] == [False] * 3 + [True] * 2


def test_a_short_shared_prefix_is_no_affinity():
    loads = [policy.Load("a", 0, 32), policy.Load("b", 0, 32)]
    assert policy.plan(loads, {"a": 1}, 20, T).reason == "least_loaded"  # 5 % of the prompt
    assert policy.plan(loads, {"a": 2}, 20, T).reason == "prefix"


def test_without_affinity_the_emptiest_cache_wins_a_tie_and_saturated_replicas_rank_last():
    loads = [policy.Load("a", 1, 32), policy.Load("b", 1, 32), policy.Load("c", 16, 32), policy.Load("d", 2, 32)]
    chosen = policy.plan(loads, {}, 5, T, cache_size={"a": 50, "b": 3, "c": 0, "d": 0}.get)
    assert chosen.ranks == [["b"], ["a", "d"], ["c"]]


def test_a_threshold_in_requests_holds_affinity_until_the_engines_batch_is_full_whatever_is_admitted():
    """A region's replicas are saturated at their engine's batch (``saturated_at``, its
    max_num_seqs), so admitting more (max_ongoing_requests 96 -> 128) moves nothing; never past
    what a replica admits."""
    batch = policy.Thresholds(saturated_at=64)
    for admitted in (96, 128):
        assert not batch.saturated(policy.Load("a", 63, admitted)) and batch.saturated(policy.Load("a", 64, admitted))
    assert batch.saturated(policy.Load("a", 48, 48))  # admitted below the batch: full is saturated
    assert T.saturated(policy.Load("a", 48, 96)) and not batch.saturated(policy.Load("a", 48, 96))
    pinned = [policy.Load("a", 60, 96), policy.Load("b", 0, 96)]
    assert policy.plan(pinned, {}, 5, batch, pinned="a").reason == "session"
    assert policy.plan(pinned, {}, 5, T, pinned="a").reason == "shed"


def test_decisions_are_taken_once_and_bounded(monkeypatch):
    monkeypatch.setattr(decisions, "MAX_PENDING", 3)
    for i in range(5):
        decisions.publish(f"r{i}", decisions.Decision("prefix", "a", 0, 0))
    assert decisions.take("r0") is None and decisions.take("r4") is not None and decisions.take("r4") is None


def test_a_replica_that_did_not_answer_its_probe_ranks_last_and_keeps_no_session_or_prefix():
    """An unknown count (the probe failed: a hung or dying replica) is not an empty replica."""
    loads = [policy.Load("a", 5, 32), policy.Load("hung", None, 32), policy.Load("full", 20, 32)]
    chosen = policy.plan(loads, {}, 5, T)
    assert (chosen.choice, chosen.reason) == ("a", "least_loaded")
    assert chosen.ranks == [["a"], ["full"], ["hung"]]
    pinned = policy.plan(loads, {}, 5, T, pinned="hung")
    assert (pinned.choice, pinned.reason) == ("a", "shed")
    holder = policy.plan(loads, {"hung": 5}, 5, T)
    assert holder.choice == "a"
    alone = policy.plan([policy.Load("hung", None, 32)], {"hung": 5}, 5, T, pinned="hung")
    assert (alone.choice, alone.reason) == ("hung", "session")  # nothing better: Serve probes it again
    unknown = [policy.Load("x", None, 32), policy.Load("y", None, 32)]
    assert policy.plan(unknown, {"y": 5}, 5, T).choice == "y"  # none known: the prefix still decides
