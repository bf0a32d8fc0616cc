"""The request router's decision for one request, handed to the pipeline that made the call.

The request router runs inside the router replica's process, in its Serve handle (Ray 2.60
instantiates a deployment's ``RequestRouter`` in every process that holds a handle to it), on
the same event loop as the pipeline (``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0``; with a
separate loop a dict operation is still atomic). When Serve has the replica's acceptance it
calls the router's ``on_request_routed``, which ``publish``-es the decision under the router's
request id (``wire.Call.request_id``); the pipeline ``take``-s it once the call's first item is
in, for the request's span. A decision nobody takes (a call given up before its head) is dropped
oldest first past ``MAX_PENDING``.
"""

from collections import OrderedDict
from dataclasses import dataclass

MAX_PENDING = 10_000


@dataclass(frozen=True, slots=True)
class Decision:
    # policy.py: session | prefix | least_loaded | shed | fallback | default; a direct line's
    # call (router/lines.py): only_replica
    reason: str
    replica: str  # the Serve replica id (the trailer's ``replica``)
    matched_chars: int  # how much of the prompt's prefix the chosen replica was known to hold
    prompt_chars: int
    # or "default" (Serve's power of two, the comparison arm), or "direct_line" (no handle call)
    policy: str = "prefix_affinity"


_pending: OrderedDict[str, Decision] = OrderedDict()


def publish(request_id: str, decision: Decision) -> None:
    _pending[request_id] = decision
    while len(_pending) > MAX_PENDING:
        _pending.popitem(last=False)


def take(request_id: str) -> Decision | None:
    return _pending.pop(request_id, None)
