"""How a replica is chosen for one request: plain data in, a plan out (no Ray, no I/O).

In order:

1. **Affinity.** The replica the request wants: the one its session is pinned to (the caller
   said which conversation this is, ``session.py``), else the one known to hold the longest
   prefix of its prompt (``index.py``), if that prefix is at least ``min_match_fraction`` of the
   prompt (a shared greeting is not worth a detour).
2. **Load.** A replica is *saturated* when its ongoing requests reach ``saturated_at`` (a
   region's: its engine's batch, ``max_num_seqs``) or, unset, ``saturated_fraction`` of its
   ``max_ongoing_requests`` (the local configs admit twice the engine's batch, so 0.5 means the
   engine would queue it). A prefix replica must also be within ``max_imbalance_fraction`` ×
   ``max_ongoing_requests`` of the least-loaded one, so that a popular system prompt does not
   pull every new conversation onto one replica; a session the caller named only has to be
   unsaturated (it asked for it, and its whole history is there) — but an end user's id
   (``pinned_loosely``: OpenAI's ``user``, Anthropic's ``metadata.user_id``, often one value for
   a whole app) must be within the imbalance too, and so must any pin once every replica is
   saturated: a tenant's whole traffic on one replica, or a queue there far longer than the
   others', is not what a session is for. An end user's pin places only what no replica holds a
   prefix of (a new conversation): its pin moves as load does, the prefix stays.
3. **Shedding.** A wanted replica that fails (2) is passed over — the request would queue behind
   it longer than a prefill elsewhere costs — for the best prefix holder among the replicas that
   pass, else the least loaded (``shed``); with no affinity at all it is the least loaded
   (``least_loaded``), ties going to the replica whose cache holds least (most room), then at
   random.

The plan ranks the replicas for Serve's selection loop: the choice first, then the others by
load, saturated ones last. Serve still checks each against its real queue (a replica at
``max_ongoing_requests`` rejects), so a choice that turned full falls through to the next rank.
"""

import math
import random
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

# Why the replica was chosen (the span's serve_app.routing.reason).
SESSION, PREFIX, LEAST_LOADED, SHED, DEFAULT, FALLBACK = "session", "prefix", "least_loaded", "shed", "default", "fallback"


@dataclass(frozen=True, slots=True)
class Load:
    replica: Hashable
    ongoing: int | None  # None: no fresh count (Serve probes it when it selects)
    max_ongoing: int


@dataclass(frozen=True)
class Thresholds:
    saturated_fraction: float = 0.5
    max_imbalance_fraction: float = 0.25
    min_match_fraction: float = 0.1
    saturated_at: int | None = None  # ongoing requests; unset: saturated_fraction of max_ongoing

    def saturated(self, load: Load) -> bool:
        if load.ongoing is None:
            return False
        if self.saturated_at is not None:
            return load.ongoing >= min(self.saturated_at, load.max_ongoing)
        return load.ongoing >= max(1, math.ceil(self.saturated_fraction * load.max_ongoing))

    def imbalance(self, load: Load) -> int:
        return max(1, round(self.max_imbalance_fraction * load.max_ongoing))


@dataclass(frozen=True)
class Plan:
    reason: str
    choice: Hashable
    ranks: list[list[Hashable]]
    matched_blocks: Mapping[Hashable, int] = field(default_factory=dict)


def plan(
    loads: Sequence[Load],
    matched_blocks: Mapping[Hashable, int],
    prompt_blocks: int,
    thresholds: Thresholds,
    *,
    pinned: Hashable | None = None,
    pinned_loosely: bool = False,
    cache_size: Callable[[Hashable], int] = lambda replica: 0,
) -> Plan:
    """The plan for one request over ``loads`` (at least one replica). ``pinned_loosely``: the
    pin is an end user's, not a conversation's (the module's docstring, 2)."""
    depth = {load.replica: matched_blocks.get(load.replica, 0) for load in loads}
    unsaturated = [load for load in loads if not thresholds.saturated(load)]
    # Every replica saturated: the one it wants takes it if it is near the least loaded (a pin
    # below, as a prefix always), else the least loaded does.
    full = not unsaturated
    unsaturated = unsaturated or list(loads)

    def by_load(load: Load) -> tuple[bool, int, int]:
        # A replica whose count is unknown did not answer its probe (hung, dying): last, not "empty".
        return (load.ongoing is None, load.ongoing or 0, cache_size(load.replica))

    least = _pick(unsaturated, by_load)

    def near_least(load: Load) -> bool:
        return (_known(load) or not _known(least)) and (
            (load.ongoing or 0) - (least.ongoing or 0) <= thresholds.imbalance(load))

    def best_holder(among: Sequence[Load]) -> Load | None:
        needed = max(1, math.ceil(thresholds.min_match_fraction * prompt_blocks))
        deepest = max((depth[load.replica] for load in among), default=0)
        if prompt_blocks == 0 or deepest < needed:
            return None
        return _pick([load for load in among if depth[load.replica] == deepest], by_load)

    wanted = next((load for load in loads if pinned is not None and load.replica == pinned), None)
    holder = best_holder(loads)
    if wanted is not None and pinned_loosely and holder is not None:
        wanted = None  # an end user's pin places new conversations; a known prefix places its own turns
    if wanted is not None:
        # A named session sticks through imbalance while its replica has room; never to a replica
        # that did not answer its probe.
        reason = SESSION
        acceptable = (full or not thresholds.saturated(wanted)) and (_known(wanted) or not _known(least))
        if pinned_loosely or full:
            acceptable = acceptable and near_least(wanted)
    else:
        wanted, reason = holder, PREFIX
        acceptable = wanted is not None and (full or not thresholds.saturated(wanted)) and near_least(wanted)
    if wanted is None:
        choice, reason = least, LEAST_LOADED
    elif acceptable:
        choice = wanted
    else:
        choice = best_holder([load for load in unsaturated if near_least(load)]) or least
        reason = SHED
    return Plan(reason, choice.replica, _ranks(choice, loads, thresholds, by_load), depth)


def default_plan(replicas: Sequence[Hashable], matched_blocks: Mapping[Hashable, int] | None = None) -> Plan:
    """Serve's own policy, for the comparison arm: two replicas at random, the less loaded wins
    (Serve's selection loop compares their queues). ``matched_blocks`` only informs the span."""
    two = random.sample(list(replicas), min(2, len(replicas)))
    return Plan(DEFAULT, two[0], [two], dict(matched_blocks or {}))


def _ranks(choice: Load, loads: Sequence[Load], thresholds: Thresholds, by_load) -> list[list[Hashable]]:
    rest = sorted((load for load in loads if load is not choice), key=by_load)
    ranks = [[choice.replica], [load.replica for load in rest if _known(load) and not thresholds.saturated(load)],
             [load.replica for load in rest if thresholds.saturated(load)],
             [load.replica for load in rest if not _known(load)]]
    return [rank for rank in ranks if rank]


def _known(load: Load) -> bool:
    return load.ongoing is not None


def _pick(loads: Sequence[Load], key) -> Load:
    """The smallest by ``key``, ties broken at random: no replica is favoured for coming first."""
    best = min(key(load) for load in loads)
    return random.choice([load for load in loads if key(load) == best])
