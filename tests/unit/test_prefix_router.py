"""The model deployments' request router (serve_app/routing/router.py) inside Serve's own routing
loop: ``_choose_replica_for_request`` runs Ray's real selection (queue-length cache, probes,
ranks, exact-match assignment) over fake replicas that answer queue-length probes; each routed
request then gets the callbacks Serve's Router gives it (``on_send_request``,
``on_request_routed``)."""

import asyncio
import dataclasses
import uuid

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from serve_app.routing import decisions, session
from serve_app.routing.router import PrefixAffinityRouter
from serve_app.wire.messages import Call

DEPLOYMENT = DeploymentID(name="model-qwen", app_name="llm")
SYSTEM = "You are a coding agent. " + "Follow the repository's conventions and explain nothing twice. " * 60
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]


class FakeReplica:
    """What Serve's selection reads of a replica; ``ongoing`` is its own count of requests."""

    def __init__(self, name: str, ongoing: int = 0, max_ongoing: int = 32):
        self.replica_id = ReplicaID(name, DEPLOYMENT)
        self.ongoing, self.max_ongoing_requests = ongoing, max_ongoing
        self.node_id, self.availability_zone, self.multiplexed_model_ids = "node", None, set()
        self.is_cross_language = False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.ongoing


class Harness:
    def __init__(self, replicas: list[FakeReplica], **kwargs):
        self.replicas = {r.replica_id.unique_id: r for r in replicas}
        self.router = PrefixAffinityRouter(
            deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True
        )
        self.router.initialize_state(**kwargs)
        self.router.update_replicas(replicas)

    async def route(self, call: Call, method: str = "chat") -> str:
        """Route ``call`` as Serve's Router would, leave it running; the replica's name."""
        metadata = RequestMetadata(request_id=call.request_id, internal_request_id=str(uuid.uuid4()), call_method=method)
        pending = PendingRequest(args=[call], kwargs={}, metadata=metadata)
        replica = await asyncio.wait_for(self.router._choose_replica_for_request(pending), 5)
        self.router.on_send_request(replica.replica_id)
        replica.ongoing += 1
        self.router.on_request_routed(pending, replica.replica_id, None)
        return replica.replica_id.unique_id

    def finish(self, name: str) -> None:
        replica = self.replicas[name]
        replica.ongoing -= 1
        self.router.decrement_queue_len_cache(replica.replica_id)

    def load(self, name: str, ongoing: int) -> None:
        """The replica's load as a fresh probe (or acceptance) would report it."""
        self.replicas[name].ongoing = ongoing
        self.router.on_new_queue_len_info(self.replicas[name].replica_id, ongoing)


def chat(turns: list[str], *, salt: str = "owner-a", sess: str | None = None, system: str = SYSTEM) -> Call:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return Call({"model": "qwen", "messages": messages, "tools": TOOLS}, uuid.uuid4().hex, cache_salt=salt, session=sess)


def run(scenario):
    return asyncio.run(scenario())


def test_a_conversations_next_turn_goes_to_the_replica_that_holds_its_prefix_and_the_span_is_told():
    async def scenario():
        h = Harness([FakeReplica("a"), FakeReplica("b")])
        first = await h.route(call1 := chat(["Fix the failing test in parser.py."]))
        h.finish(first)
        other = "b" if first == "a" else "a"
        h.load(first, 3)  # busier than the other, but within the imbalance the policy allows (8)
        second = await h.route(call2 := chat(["Fix the failing test in parser.py.", "Done: see the diff.", "Now lint it."]))
        return first, other, second, decisions.take(call1.request_id), decisions.take(call2.request_id)

    first, other, second, d1, d2 = run(scenario)
    assert second == first
    assert (d1.reason, d1.matched_chars, d1.replica) == ("least_loaded", 0, first)
    assert d2.reason == "prefix" and d2.replica == first
    # Everything turn 1 sent, to its last whole block, is known to be in that replica's cache.
    assert d1.prompt_chars - 256 < d2.matched_chars <= d1.prompt_chars
    assert decisions.take(d2.replica) is None  # taken once


def test_a_saturated_replica_sheds_affinity_instead_of_queueing_the_turn_behind_it():
    async def scenario():
        h = Harness([FakeReplica("a"), FakeReplica("b")])
        first = await h.route(chat(["Refactor the router."]))
        other = "b" if first == "a" else "a"
        h.load(first, 16)  # half of max_ongoing 32: its engine's batch is full...
        h.load(other, 10)  # ...and the other's is not, though within the imbalance allowed (8)
        second = await h.route(call := chat(["Refactor the router.", "Which part?", "The retry loop."]))
        return first, second, decisions.take(call.request_id)

    first, second, decision = run(scenario)
    assert second != first
    assert (decision.reason, decision.matched_chars) == ("shed", 0)


def test_a_threshold_in_requests_keeps_the_turn_on_its_prefix_until_the_engines_batch_is_full():
    """A region's routing options (``saturated_at``: its engine's batch) reach the policy through
    Serve's ``request_router_kwargs``."""
    async def scenario():
        h = Harness([FakeReplica("a"), FakeReplica("b")], saturated_at=20)
        first = await h.route(chat(["Refactor the router."]))
        h.load(first, 16)  # half of max_ongoing 32, but 4 seats of a batch of 20 still free
        h.load("b" if first == "a" else "a", 10)
        second = await h.route(call := chat(["Refactor the router.", "Which part?", "The retry loop."]))
        return first, second, decisions.take(call.request_id)

    first, second, decision = run(scenario)
    assert second == first and decision.reason == "prefix"


@pytest.mark.parametrize("busier, lands_on_holder", [(8, True), (9, False)])
def test_a_prefix_is_followed_only_while_its_replica_is_within_the_imbalance_of_the_least_loaded(busier, lands_on_holder):
    async def scenario():
        h = Harness([FakeReplica("a"), FakeReplica("b")])
        first = await h.route(chat(["Write the migration."]))
        h.finish(first)
        h.load(first, busier)  # 0.25 × 32 = 8 more than the other at most
        return first, await h.route(chat(["Write the migration.", "Which table?", "users"]))

    first, second = run(scenario)
    assert (second == first) is lands_on_holder


def test_one_owners_cached_prompt_is_never_anothers_affinity():
    """The engine partitions its cache by cache_salt; the index does too, so owner B's identical
    prompt is not sent after A's blocks (which B could never hit)."""
    async def scenario():
        h = Harness([FakeReplica("a"), FakeReplica("b")])
        await h.route(chat(["Same words."], salt="owner-a"))
        await h.route(call := chat(["Same words."], salt="owner-b"))
        return decisions.take(call.request_id)

    decision = run(scenario)
    assert (decision.reason, decision.matched_chars) == ("least_loaded", 0)


@pytest.mark.parametrize("method", ["count_tokens", "tokenize"])
def test_a_route_without_a_cache_partition_is_routed_by_load_and_learns_nothing_of_another_owner(method):
    """tokenize, detokenize and count_tokens carry no cache_salt (they never reach the KV cache):
    routing them by prefix or session would chain every owner's prompts from one seed, so owner B
    would learn from ``routing.reason`` whether owner A sent a prompt (or a session name)."""
    async def scenario():
        h = Harness([FakeReplica("a"), FakeReplica("b")])
        unsalted = dataclasses.replace(chat(["A's confidential plan."], salt=None, sess="s-1"), request_id="a")
        first = await h.route(unsalted, method)
        h.finish(first)
        other = "b" if first == "a" else "a"
        h.load(first, 3)  # within the imbalance a prefix or session would be followed across
        guess = dataclasses.replace(unsalted, request_id="b")
        second = await h.route(guess, method)
        return other, second, decisions.take("a"), decisions.take("b")

    other, second, d1, d2 = run(scenario)
    assert (d1.reason, d1.matched_chars) == ("least_loaded", 0)
    assert (second, d2.reason, d2.matched_chars) == (other, "least_loaded", 0)


def test_a_named_session_stays_on_its_replica_and_moves_with_it_when_that_one_saturates():
    async def scenario():
        h = Harness([FakeReplica("a"), FakeReplica("b")])
        key = session.session_key({"x-session-id": "agent-7"}, {})
        home = await h.route(chat(["Start."], sess=key))
        h.finish(home)
        h.load(home, 6)  # busier, but a pin only needs its replica unsaturated
        unrelated = await h.route(one := chat(["A prompt sharing nothing."], sess=key, system="other"))
        h.finish(unrelated)
        h.load(home, 16)
        moved = await h.route(two := chat(["Again."], sess=key, system="other"))
        h.finish(moved)
        h.load(home, 0)
        h.load(moved, 5)
        stays = await h.route(chat(["Once more."], sess=key, system="other"))
        return home, unrelated, moved, stays, decisions.take(one.request_id), decisions.take(two.request_id)

    home, unrelated, moved, stays, d1, d2 = run(scenario)
    assert unrelated == home and d1.reason == "session"
    assert moved != home and d2.reason == "shed"
    assert stays == moved  # re-pinned where its history now is


def test_one_user_id_for_a_whole_app_spreads_its_requests_a_named_session_stays():
    """An app that sends ``user: "my-app"`` on every request: 12 concurrent requests are spread
    within the imbalance (8), not all on one replica as a named conversation's are (it stays while
    its replica has room: 16)."""
    async def scenario(key):
        h = Harness([FakeReplica("a"), FakeReplica("b")])
        placed = [await h.route(chat([f"Question {i}."], sess=key, system=f"app {i}")) for i in range(12)]
        return {name: placed.count(name) for name in "ab"}

    spread = run(lambda: scenario(session.session_key({}, {"user": "my-app"})))
    stays = run(lambda: scenario(session.session_key({"x-session-id": "agent-7"}, {})))
    assert sorted(stays.values()) == [0, 12]
    assert min(spread.values()) >= 2 and max(spread.values()) - min(spread.values()) <= 8 + 1


def test_an_unstored_responses_answer_pins_nothing():
    """``store: false``: no later turn can name it (``previous_response_id``), so its pin would
    only push named sessions out of the table."""
    async def scenario():
        h = Harness([FakeReplica("a"), FakeReplica("b")])
        for store in (True, False):
            call = Call({"model": "qwen", "input": "hi", "store": store}, uuid.uuid4().hex, cache_salt="owner-a")
            await h.route(call, method="responses")
        return len(h.router._sessions)

    assert run(scenario) == 1


def test_a_resumed_stream_moves_its_sessions_pin_to_the_replica_that_continued_it():
    """The router's part (the continuation's call names its session: test_resume.py checks the
    router's pipeline sends it)."""
    async def scenario():
        h = Harness([FakeReplica("a"), FakeReplica("b")])
        key = session.session_key({"x-session-id": "agent-7"}, {})
        home = await h.route(chat(["Start."], sess=key))
        h.finish(home)
        resumed = dataclasses.replace(chat(["Start."], sess=key), avoid_replica=home)  # its engine failed
        elsewhere = await h.route(resumed)
        h.finish(elsewhere)
        later = await h.route(chat(["Next turn."], sess=key, system="other"))
        return home, elsewhere, later

    home, elsewhere, later = run(scenario)
    assert elsewhere != home and later == elsewhere


def test_sessions_of_two_owners_with_the_same_key_are_two_sessions():
    async def scenario():
        h = Harness([FakeReplica("a"), FakeReplica("b")])
        key = session.session_key({"x-session-id": "s"}, {})
        home = await h.route(chat(["x"], salt="owner-a", sess=key))
        await h.route(call := chat(["y"], salt="owner-b", sess=key, system="unrelated"))
        return home, decisions.take(call.request_id)

    _, decision = run(scenario)
    assert decision.reason == "least_loaded"


def test_a_responses_turn_continues_on_the_replica_of_the_response_it_continues():
    async def scenario():
        h = Harness([FakeReplica("a"), FakeReplica("b")])
        first = Call({"model": "qwen", "input": [{"role": "user", "content": "Plan the release."}]}, "r1", cache_salt="o")
        home = await h.route(first, method="responses")
        h.finish(home)
        h.load(home, 4)
        # The next turn names resp_r1; even a body sharing nothing with the first is pinned.
        key = session.session_key({}, {}, previous_response_id=session.response_id("r1"))
        nxt = Call({"model": "qwen", "input": [{"role": "user", "content": "zzz"}]}, "r2", cache_salt="o", session=key)
        return home, await h.route(nxt, method="responses"), decisions.take("r2")

    home, second, decision = run(scenario)
    assert second == home and decision.reason == "session"


def test_a_replica_that_leaves_takes_its_index_and_pins_with_it():
    async def scenario():
        a, b = FakeReplica("a"), FakeReplica("b")
        h = Harness([a, b])
        key = session.session_key({"x-session-id": "k"}, {})
        home = await h.route(chat(["Hello there."], sess=key))
        survivor = b if home == "a" else a
        h.router.update_replicas([survivor])
        await h.route(call := chat(["Hello there.", "Hi.", "Go on."], sess=key))
        pins = list(h.router._sessions.values())
        h.router.on_replica_actor_died(survivor.replica_id)  # the session's new home dies too
        session_key = next(iter(h.router._sessions))
        return survivor, decisions.take(call.request_id), h.router._index.size(h.replicas[home].replica_id), pins, \
            h.router._pinned(session_key), list(h.router._sessions.values())

    survivor, decision, left_blocks, pins, pinned_after_death, pins_after_death = run(scenario)
    assert decision.replica == survivor.replica_id.unique_id
    assert decision.reason == "least_loaded" and left_blocks == 0
    assert pins == [survivor.replica_id] and pinned_after_death is None and pins_after_death == []


def test_when_the_chosen_replica_turns_out_full_serve_falls_through_and_the_span_says_so():
    async def scenario():
        h = Harness([FakeReplica("a", max_ongoing=4), FakeReplica("b", max_ongoing=4)], saturated_fraction=2.0)
        first = await h.route(chat(["Deploy it."]))
        # The router's cache says 1, but the replica is full (another router's requests).
        h.replicas[first].ongoing = 4
        h.router._replica_queue_len_cache.invalidate_key(h.replicas[first].replica_id)
        h.router.on_new_queue_len_info(h.replicas[first].replica_id, 4)
        second = await h.route(call := chat(["Deploy it.", "Where?", "Staging."]))
        return first, second, decisions.take(call.request_id)

    first, second, decision = run(scenario)
    assert second != first and decision.reason in ("fallback", "shed")


def test_the_comparison_arm_routes_by_serves_default_and_says_so():
    default_key = next(k for k in (f"h:bench-{i}" for i in range(100)) if session.compare_arm(k) == "default")
    prefix_key = next(k for k in (f"h:bench-{i}" for i in range(100)) if session.compare_arm(k) == "prefix")

    async def scenario():
        h = Harness([FakeReplica("a"), FakeReplica("b")], compare_with_default=True)
        await h.route(d := chat(["t"], sess=default_key))
        await h.route(p := chat(["t"], sess=prefix_key))
        return decisions.take(d.request_id), decisions.take(p.request_id)

    default, ours = run(scenario)
    assert (default.policy, default.reason) == ("default", "default")
    assert ours.policy == "prefix_affinity" and ours.reason != "default"


def test_a_request_that_is_not_a_call_is_routed_by_serves_policy():
    async def scenario():
        h = Harness([FakeReplica("a"), FakeReplica("b")])
        metadata = RequestMetadata(request_id="x", internal_request_id="y", call_method="check")
        replica = await h.router._choose_replica_for_request(PendingRequest(args=[], kwargs={}, metadata=metadata))
        return replica.replica_id.unique_id

    assert run(scenario) in ("a", "b")


def test_a_resumed_stream_avoids_the_replica_whose_engine_failed_it_even_though_that_one_holds_its_prefix():
    async def scenario():
        h = Harness([FakeReplica("a"), FakeReplica("b")])
        turns = ["Fix the failing test in parser.py."]
        first = await h.route(chat(turns, sess="s1"))
        h.finish(first)
        # Its engine died mid-stream; Serve still lists it (its health checks have not failed yet).
        resumed = await h.route(dataclasses.replace(chat(turns, sess="s1"), avoid_replica=first))
        alone = Harness([FakeReplica("a")])  # the only replica: the resume is still routed
        return first, resumed, await alone.route(dataclasses.replace(chat(turns), avoid_replica="a"))

    first, resumed, alone = run(scenario)
    assert resumed != first and alone == "a"


def test_while_every_replica_is_full_a_request_waits_with_serves_backoff_not_in_a_loop():
    """Each choose_replicas ranks every candidate, so a miss means all were full: Serve 2.60 retries
    at once unless the router asks for its backoff (routing_context.should_backoff), and then spun
    hundreds of calls and probes a second per waiting request. With the backoff, a few."""
    async def scenario():
        h = Harness([FakeReplica("a", ongoing=32), FakeReplica("b", ongoing=32)])
        calls = 0
        choose = h.router.choose_replicas

        async def counted(*args, **kwargs):
            nonlocal calls
            calls += 1
            return await choose(*args, **kwargs)

        h.router.choose_replicas = counted
        routed = asyncio.ensure_future(h.route(chat(["Summarise the build log."])))
        await asyncio.sleep(0.5)  # every replica full for half a second
        waited = calls
        h.load("b", 0)  # a slot frees up
        return waited, await asyncio.wait_for(routed, 5)

    waited, replica = run(scenario)
    assert replica == "b"
    # Serve's default backoff here (25 ms doubling; a deployment's is 5 ms doubling to 50 ms, ~14):
    # ~6 calls in 0.5 s; without it, thousands.
    assert 1 <= waited <= 20


def test_a_request_given_up_before_any_replica_took_it_leaves_neither_its_body_nor_its_entry():
    """A client that leaves while its call queues (every replica full) never reaches
    on_request_routed: its entry kept the whole Call, up to MAX_ROUTING of them."""
    from serve_app.routing import router as router_module

    async def scenario():
        h = Harness([FakeReplica("a", ongoing=32)])
        given_up = []
        for _ in range(router_module.SWEEP_EVERY - 1):
            call = chat(["x" * 4000])
            metadata = RequestMetadata(request_id=call.request_id, internal_request_id=str(uuid.uuid4()),
                                       call_method="chat")
            pending = PendingRequest(args=[call], kwargs={}, metadata=metadata)
            task = asyncio.ensure_future(h.router._choose_replica_for_request(pending))
            await asyncio.sleep(0)
            await asyncio.sleep(0.001)
            task.cancel()  # the caller gives up: Serve cancels the request's future
            await asyncio.gather(task, return_exceptions=True)
            given_up.append(pending)
        kept = len(h.router._routing)
        assert all(not hasattr(entry, "call") for entry in h.router._routing.values())
        h.load("a", 0)
        await h.route(chat(["the next one"]))  # the SWEEP_EVERY-th insertion looks for the given up
        return kept, len(h.router._routing)

    kept, after = run(scenario)
    assert kept == router_module.SWEEP_EVERY - 1 and after == 0


def test_a_replica_that_does_not_answer_its_probe_is_not_waited_for_on_every_request():
    """Hung (Serve drops it only once its health checks fail, up to ~90 s later): each request
    waited out the probe's 100 ms deadline for it. Now one request in UNANSWERED_HOLD_S does."""
    from serve_app.routing import router as router_module

    class Hung(FakeReplica):
        probes = 0

        async def get_queue_len(self, *, deadline_s: float) -> int:
            Hung.probes += 1
            await asyncio.sleep(3600)

    async def scenario():
        h = Harness([FakeReplica("a"), Hung("hung")])
        routed = []
        for _ in range(10):
            replica = await h.route(chat([f"question {uuid.uuid4().hex}"]))
            routed.append(replica)
            h.finish(replica)
            h.router._replica_queue_len_cache.invalidate_key(h.replicas["hung"].replica_id)
        return routed

    routed = run(scenario)
    # Ours twice (ten before: each request waited out its deadline), and Serve's own selection may
    # probe it once more in the background.
    assert set(routed) == {"a"} and Hung.probes <= router_module.UNANSWERED_MISSES + 1
    assert router_module.UNANSWERED_HOLD_S >= 1


def test_a_replica_late_to_answer_one_probe_keeps_its_sessions_turns():
    """A busy but healthy replica whose probe misses its deadline once: not held (its load would be
    unknown, ranked last, for the whole hold, and its sessions' turns sent elsewhere for good)."""
    class SlowOnce(FakeReplica):
        slow_next = False

        async def get_queue_len(self, *, deadline_s: float) -> int:
            if self.slow_next:
                self.slow_next = False
                await asyncio.sleep(deadline_s * 3)  # one probe late (a busy loop, a GC pause)
            return self.ongoing

    async def scenario():
        b = SlowOnce("b")
        h = Harness([FakeReplica("a"), b])
        h.load("a", 5)
        h.load("b", 0)
        first = await h.route(chat(["Plan the migration."], sess="s1"))
        h.finish(first)
        b.slow_next = True  # the next probe of b, made for another request, is late
        h.router._replica_queue_len_cache.invalidate_key(b.replica_id)  # stale, as after 10 s in Serve
        h.finish(await h.route(chat([f"unrelated {uuid.uuid4().hex}"])))
        turns = []
        for turn in range(3):  # the session's next turns, b answering on time again
            h.router._replica_queue_len_cache.invalidate_key(b.replica_id)
            call = chat(["Plan the migration.", "ok", f"next {turn}"], sess="s1")
            replica = await h.route(call)
            h.finish(replica)
            turns.append((replica, decisions.take(call.request_id).reason))
        return first, turns

    first, turns = run(scenario)
    assert first == "b" and turns == [("b", "session")] * 3
