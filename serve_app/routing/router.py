"""``PrefixAffinityRouter``: the model deployments' Serve request router (Ray 2.60's
``RequestRouter`` API), named by ``request_router_config`` (docs/architecture.md, "How a replica
is chosen").

Serve instantiates it in each process holding a handle to the deployment — the router replicas —
and calls ``choose_replicas`` for each pending request (again after a backoff if every replica it
ranked was full: each call ranks all it means Serve to try before waiting, so it asks Serve for
that backoff, ``routing_context.should_backoff``; without it Serve 2.60 retries at once, in a loop of calls and
queue-length probes while the replicas are full), then ``on_request_routed`` once a replica has
accepted it. The pending request's
argument is our ``wire.Call``. This class is glue: the prompt's blocks (``prompt.py``), the
index of what each replica served (``index.py``), the session pins, and the choice itself
(``policy.py``); the decision goes to the request's span through ``decisions.py``.

It keeps Serve's exact-match assignment (no ``FIFOMixin``: the replica chosen for a request is
given to that request, not to the oldest waiting one, or affinity would be handed to a stranger)
and Serve's own load view: the queue-length cache the handle keeps (+1 on send, −1 on completion,
the replica's own count on each acceptance), probed when stale.

State is per router replica: a client whose turns reach two router replicas is matched by each
one's view (a session reconnecting elsewhere costs one prefill there, then sticks again).
"""

import math
import time
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from serve_app.routing import decisions, policy
from serve_app.routing.index import DEFAULT_MAX_BLOCKS, PrefixIndex
from serve_app.routing.prompt import DEFAULT_BLOCK_CHARS, PromptBlocks, prompt_blocks
from serve_app.routing.session import compare_arm, loose, response_id, response_session
from serve_app.telemetry.logs import module_logger
from serve_app.wire.messages import Call

logger = module_logger(__name__)

PATH = "serve_app.routing.router:PrefixAffinityRouter"  # request_router_config.request_router_class
DEFAULT_REPLICA_CACHE_CHARS = 2_000_000  # ≈ 500k tokens of prefix cache per engine
MAX_SESSIONS = 100_000
MAX_ROUTING = 10_000  # requests between their first choose_replicas and their acceptance
# Entries of requests given up before any replica accepted them (the client left while the call
# queued; a resume's deadline) are looked for this often, in insertions.
SWEEP_EVERY = 256
# A replica that did not answer its queue-length probe twice in a row (hung: Serve drops it only
# after its health checks fail, up to ~90 s) is not probed again for this long: each request
# waited out the probe's deadline (100 ms) for it. Its load is unknown meanwhile, as after a failed
# probe (policy.py ranks it last). One late answer is not enough: a busy healthy replica would lose
# its sessions' turns for the whole hold.
UNANSWERED_HOLD_S = 5.0
UNANSWERED_MISSES = 2


@dataclass
class _Routing:
    """One pending request, as the router sees it (computed once, reused across backoffs). Not the
    ``Call``: an entry may outlive its request (given up while queued), and the body with it."""

    request: weakref.ref  # Serve's PendingRequest, while Serve or its caller holds it
    request_id: str
    avoid_replica: str | None
    compare_arm: str | None
    blocks: PromptBlocks
    session: int | None  # the pin it looks up
    pins: tuple[int, ...]  # the pins its replica gets
    loose: bool = False  # its session names an end user, not a conversation (``session.loose``)
    plan: policy.Plan | None = None

    def given_up(self) -> bool:
        pending = self.request()
        return pending is None or pending.future.cancelled()


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(
        self,
        block_chars: int = DEFAULT_BLOCK_CHARS,
        replica_cache_chars: int = DEFAULT_REPLICA_CACHE_CHARS,
        max_index_blocks: int = DEFAULT_MAX_BLOCKS,
        saturated_fraction: float = 0.5,
        saturated_at: int | None = None,
        max_imbalance_fraction: float = 0.25,
        min_match_fraction: float = 0.1,
        max_sessions: int = MAX_SESSIONS,
        compare_with_default: bool = False,
    ) -> None:
        """``request_router_kwargs`` (docs/operations.md, "Request routing" has each)."""
        self._block_chars = block_chars
        self._index = PrefixIndex(max(1, replica_cache_chars // block_chars), max_index_blocks)
        self._index.sync(self._replica_id_set)
        self._thresholds = policy.Thresholds(saturated_fraction, max_imbalance_fraction, min_match_fraction,
                                             saturated_at)
        self._sessions: OrderedDict[int, ReplicaID] = OrderedDict()
        self._max_sessions = max_sessions
        self._compare = compare_with_default
        self._routing: OrderedDict[str, _Routing] = OrderedDict()
        self._inserted = 0
        # replica -> (its probes unanswered in a row, when the last went unanswered)
        self._unanswered: dict[ReplicaID, tuple[int, float]] = {}

    # --- Serve's replica set -------------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if hasattr(self, "_index"):  # Serve may call it before initialize_state
            self._index.sync(self._replica_id_set)
            self._unanswered = {r: missed for r, missed in self._unanswered.items() if r in self._replica_id_set}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.sync(self._replica_id_set)

    # --- one request ---------------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:  # what is ranked below is all there is to try at once
            pending_request.routing_context.should_backoff = True
        routing = self._routing_of(pending_request)
        if routing is not None and (avoid := routing.avoid_replica) is not None:
            # A resume: not the replica whose engine just failed it, if there is another.
            candidate_replicas = [r for r in candidate_replicas if r.replica_id.unique_id != avoid] or candidate_replicas
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        if routing is None:  # not one of our calls (a health probe's, say): Serve's own policy
            return [[by_id[replica] for replica in policy.default_plan(list(by_id)).ranks[0]]]
        matched = self._index.match(routing.blocks.hashes, by_id)
        if self._compare and routing.compare_arm == "default":
            chosen = policy.default_plan(list(by_id), matched)
        else:
            chosen = policy.plan(
                await self._loads(candidate_replicas), matched, len(routing.blocks.hashes), self._thresholds,
                pinned=self._pinned(routing.session), pinned_loosely=routing.loose, cache_size=self._index.size,
            )
        routing.plan = chosen
        return [[by_id[replica] for replica in rank if replica in by_id] for rank in chosen.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        routing = self._routing.pop(pending_request.metadata.internal_request_id, None)
        if routing is None:
            return
        try:
            self._index.record(replica_id, routing.blocks.hashes)
            for pin in routing.pins:
                self._pin(pin, replica_id)
            decisions.publish(routing.request_id, _decision(routing, replica_id))
        except Exception:  # routing bookkeeping must never fail the request it routed
            logger.exception("could not record the routing of request %s", routing.request_id)

    # --- helpers -------------------------------------------------------------------------------
    def _routing_of(self, pending_request: PendingRequest | None) -> _Routing | None:
        """The request's blocks and session keys; None for a request that is not a ``Call``."""
        if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], Call):
            return None
        key = pending_request.metadata.internal_request_id
        if (routing := self._routing.get(key)) is not None:
            return routing
        call = pending_request.args[0]
        if call.cache_salt is None:
            # A route that never reaches the KV cache (tokenize, detokenize, count_tokens) has no
            # owner's partition: its prompt and session are neither followed nor recorded, or one
            # owner's would be another's to find (a "prefix" or "session" in pg_metadata.routing).
            blocks, session, pins = PromptBlocks((), 0, self._block_chars), None, ()
        else:
            blocks = prompt_blocks(call.body, call.cache_salt, self._block_chars)
            session = None if call.session is None else hash((call.cache_salt, call.session))
            pins = () if session is None else (session,)
            # The next turn continues this answer, unless it is not stored (no turn can name it).
            if pending_request.metadata.call_method == "responses" and call.body.get("store") is not False:
                pins += (hash((call.cache_salt, response_session(response_id(call.request_id)))),)
        routing = _Routing(weakref.ref(pending_request), call.request_id, call.avoid_replica,
                           compare_arm(call.session) if self._compare else None, blocks, session, pins,
                           loose=session is not None and loose(call.session))
        self._remember(key, routing)
        return routing

    def _remember(self, key: str, routing: _Routing) -> None:
        """Keep ``routing`` until its request is accepted; forget those given up before (every
        ``SWEEP_EVERY`` insertions) and, past ``MAX_ROUTING``, the oldest."""
        self._routing[key] = routing
        self._inserted += 1
        if self._inserted % SWEEP_EVERY == 0:
            for gone in [k for k, entry in self._routing.items() if entry.given_up()]:
                del self._routing[gone]
        while len(self._routing) > MAX_ROUTING:
            self._routing.popitem(last=False)

    async def _loads(self, replicas: list[RunningReplica]) -> list[policy.Load]:
        """Ongoing requests per replica: the handle's queue-length cache, probed where stale, but
        for a replica held after ``UNANSWERED_MISSES`` unanswered probes in a row (``UNANSWERED_HOLD_S``)."""
        counts = {replica.replica_id: self._replica_queue_len_cache.get(replica.replica_id) for replica in replicas}
        now = time.monotonic()
        stale = [replica for replica in replicas if counts[replica.replica_id] is None and not self._held(replica, now)]
        if stale:
            for replica, count in await self._probe_queue_lens(stale, 0):
                counts[replica.replica_id] = count
                if count is None:
                    misses, _ = self._unanswered.get(replica.replica_id, (0, now))
                    self._unanswered[replica.replica_id] = (misses + 1, now)
                else:
                    self._unanswered.pop(replica.replica_id, None)
        return [policy.Load(r.replica_id, counts[r.replica_id], r.max_ongoing_requests) for r in replicas]

    def _held(self, replica: RunningReplica, now: float) -> bool:
        misses, at = self._unanswered.get(replica.replica_id, (0, -math.inf))
        return misses >= UNANSWERED_MISSES and now - at < UNANSWERED_HOLD_S

    def _pinned(self, session: int | None) -> ReplicaID | None:
        if session is None or (replica := self._sessions.get(session)) is None:
            return None
        if replica not in self._replica_id_set:  # it left, its cache with it: the pin goes too
            del self._sessions[session]  # (here, not on leaving: Serve reports a death per failed call)
            return None
        self._sessions.move_to_end(session)
        return replica

    def _pin(self, session: int, replica: Hashable) -> None:
        self._sessions[session] = replica
        self._sessions.move_to_end(session)
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)


def _decision(routing: _Routing, replica: ReplicaID) -> decisions.Decision:
    plan = routing.plan
    if plan is None:
        reason = policy.FALLBACK
    elif plan.reason == policy.DEFAULT:
        reason = policy.DEFAULT
    else:
        reason = plan.reason if plan.choice == replica else policy.FALLBACK  # its choice was full
    matched = plan.matched_blocks.get(replica, 0) if plan is not None else 0
    return decisions.Decision(
        reason=reason, replica=replica.unique_id, matched_chars=routing.blocks.chars_of(matched),
        prompt_chars=routing.blocks.chars, policy="default" if reason == policy.DEFAULT else "prefix_affinity",
    )
