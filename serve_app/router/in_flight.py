"""This router replica's count of the requests it has sent to each model and not yet seen end.

The count is what ``/health`` reports beside each model's state, so a busy region is not mistaken
for a down one, and what decides before a handle call whether the model's slots are all taken.
"""

from collections.abc import Callable, Sequence
from typing import Any

from serve_app.config import ModelDeploymentArgs


class InFlight:
    """Requests this router replica has sent to each model and not yet seen end.

    With the model's running replicas and its Serve limits this says whether the model is
    *busy* (every replica's ``max_ongoing_requests`` slots taken: new requests wait in the
    router's queue) or *shedding* (that queue holds ``max_queued_requests`` too: new requests get
    503 ``overloaded``). ``/health`` reports it next to the state, so a busy region is not
    mistaken for a down one. The count is this router replica's own: with several router
    replicas each sees its share of the traffic (the slots are shared, the queues are not).
    """

    def __init__(self, models: Sequence[ModelDeploymentArgs]):
        self._limits: dict[str, tuple[int, int]] = {}
        self._counts: dict[str, int] = {}
        self.set_models(models)

    def set_models(self, models: Sequence[ModelDeploymentArgs]) -> None:
        """New limits (the router's settings changed); the counts of requests in flight stay."""
        self._limits = {**self._limits, **{m.id: (m.max_ongoing_requests, m.max_queued_requests) for m in models}}
        for model in models:
            self._counts.setdefault(model.id, 0)

    def begin(self, model_id: str) -> Callable[[], None]:
        """Count one request; the returned callable (idempotent) uncounts it."""
        self._counts[model_id] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._counts[model_id] -= 1

        return release

    def load(self, model_id: str, running: int) -> dict[str, Any]:
        max_ongoing, max_queued = self._limits[model_id]
        slots = running * max_ongoing
        count = self._counts[model_id]
        return {
            "in_flight": count,
            "slots": slots,
            "busy": running > 0 and count >= slots,
            "shedding": running > 0 and count >= slots + max_queued,
        }
