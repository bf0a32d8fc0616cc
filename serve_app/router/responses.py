"""``/v1/responses`` at the router: stored responses, and conversations.

vLLM's Responses layer keeps stored responses in a dict inside one engine process: a follow-up
that Serve routes to another replica, or that comes after a restart, finds nothing (the limit of
Ray's own attempt, ray PR #65773). Here the engine is stateless and the router keeps them in the
response store (``response_store.py``): the key registry's database, which every router replica
of every region reads:

- a request with ``previous_response_id`` is continued by the router: it loads that response's
  conversation (its input items and its output items), puts the new input after it, and sends
  the whole conversation to the engine as ``input`` (instructions are not carried over, as
  OpenAI specifies);
- a response with ``store`` (OpenAI's default: true) is kept once it is complete or incomplete,
  with the conversation that produced it, for ``GET`` / ``DELETE /v1/responses/{id}`` and for the
  next ``previous_response_id``. A stream's final response comes in the replica's trailer.

A response belongs to the key's owner: another owner's id is "not found", never "forbidden"
(which would confirm it exists). Its id is the server's (a client's ``request_id`` is refused at
validation), and a stored row is never replaced. Nothing runs in the background, so there is
nothing to cancel: ``cancel`` on a stored response says so.
"""

import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import Response

from serve_app.auth.database import RegistryUnavailable
from serve_app.auth.refusals import registry_unavailable
from serve_app.auth.keys import ALL
from serve_app.auth.principal import Principal
from serve_app.errors import APIError
from serve_app.router.json_body import shown
from serve_app.router.response_store import ResponseIdTaken, ResponseStore, StoredResponse
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)


# Stores a finished response; returns the bytes stored (0 when nothing was), which belong in the
# request's usage record as ``stored_bytes``.
Keeper = Callable[[dict[str, Any] | None], Awaitable[int]]


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"no stored response with id {shown(response_id)!r}", param=param, code="response_not_found")


def _items(value: Any) -> list[dict[str, Any]]:
    """The ``input`` as a list of items: a string is one user message."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else list(value)


class ResponsesAPI:
    def __init__(self, store: ResponseStore):
        self.store = store

    async def continue_from(self, body: dict[str, Any], caller: Principal) -> tuple[Keeper, int]:
        """Put the conversation ``previous_response_id`` names before the new input (404 if the
        caller has no such response). Returns what keeps the result, and the bytes the history
        adds to the request (its rate-limit cost grows with it)."""
        conversation = _items(body["input"])
        added = 0
        # The engine gets the conversation instead, and so does a peer region if the request
        # fails over (its store does not have this id); the router tells the replica the id to echo.
        previous = body.pop("previous_response_id", None)
        if previous:
            try:
                found = await self.store.history(previous, caller.owner, _models(caller))
            except RegistryUnavailable as err:  # the region's store is away: retry later, not a 500
                raise registry_unavailable(err) from None
            if found is None:
                raise _not_found(previous, "previous_response_id")
            history, added = found
            conversation = history + conversation
        body["input"] = conversation
        return self._keeper(body, conversation, caller), added

    def _keeper(self, body: dict[str, Any], conversation: list[dict[str, Any]], caller: Principal) -> Keeper:
        async def keep(response: dict[str, Any] | None) -> int:
            """Store a finished response (a non-stream body, or a stream trailer's ``response``);
            the bytes stored. Never raises: the client has its answer, and a follow-up on a
            response that was not stored gets a clear 404."""
            if body.get("store") is False or not isinstance(response, dict) or "id" not in response:
                return 0
            if response.get("status") not in ("completed", "incomplete"):
                return 0
            stored = StoredResponse(
                id=response["id"],
                owner=caller.owner,
                model=body["model"],
                created_at=int(response.get("created_at") or time.time()),
                response={k: v for k, v in response.items() if k != "pg_metadata"},
                conversation=conversation,
            )
            try:
                return await self.store.put(stored)
            except ResponseIdTaken:  # the engine's ids are the server's: this is a bug, not a client
                logger.error("response %s not stored: that id is stored already (rows are never replaced)", stored.id)
            except (ValueError, RegistryUnavailable) as refused:  # too large, not Unicode; the registry away
                logger.warning("response %s not stored: %s", stored.id, refused)
            except Exception:
                logger.exception("response %s not stored", stored.id)
            return 0

        return keep

    async def retrieve(self, response_id: str, caller: Principal) -> Response:
        """The stored object's JSON as stored: the same bytes a ``JSONResponse`` of it would be."""
        text = await self.store.response_text(response_id, caller.owner, _models(caller))
        if text is None:
            raise _not_found(response_id, "response_id")
        return Response(text, media_type="application/json")

    async def delete(self, response_id: str, caller: Principal) -> dict[str, Any]:
        if not await self.store.delete(response_id, caller.owner, _models(caller)):
            raise _not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str, caller: Principal) -> dict[str, Any]:
        if not await self.store.exists(response_id, caller.owner, _models(caller)):
            raise _not_found(response_id, "response_id")  # 404 first: an unknown id is not "finished"
        raise APIError(
            400,
            "only background responses can be cancelled, and this deployment runs none: this response has finished",
            param="response_id",
            code="response_not_cancellable",
        )


def _models(caller: Principal) -> frozenset[str] | None:
    """The models whose stored responses ``caller`` may see: its key's (None: every one)."""
    return None if ALL in caller.models else caller.models
