"""Which model replica serves a request: prefix-cache affinity and session pins, as a Serve
request router on the model deployments (docs/architecture.md, "How a replica is chosen").

- ``router.py``: ``PrefixAffinityRouter``, Serve's ``RequestRouter`` for the model deployments
  (the one module here that imports Ray);
- ``policy.py``: the choice itself, plain data in and out: affinity, load, shedding;
- ``index.py``: what each replica most likely still holds in its prefix cache, bounded;
- ``prompt.py``: a request's prompt as a chain of block hashes;
- ``session.py``: the conversation a caller names (header, body fields), and its precedence;
- ``decisions.py``: the decision handed from the request router to the request's span.

The router's pipeline imports only ``session`` and ``decisions`` (no Ray there).
"""

from serve_app.routing.decisions import Decision, take as take_decision
from serve_app.routing.session import SESSION_HEADER, session_key

__all__ = ["SESSION_HEADER", "Decision", "session_key", "take_decision"]
