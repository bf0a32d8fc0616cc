"""A resumed stream's seam, on both of its sides: what the client already has, counted per
channel (the router, from the bytes it relayed), and the continuation cut down to what the client
has not (the replica).

The replica that continues a stream replays the tokens generated before the seam through vLLM's
serving layer (``engine/replay.py``), so its detokenizer, reasoning parser, tool parser and
Anthropic converter stand where the first stream's stood; then its engine goes on. The replay
emits the answer so far again — at least what the client has, and whatever the first stream still
held back (part of a character, a tool call's arguments not yet valid JSON) — in chunks grouped
its own way (vLLM merges deltas when its consumer lags; the replay goes token by token). So the
cut is made by content, not by counting chunks: per *channel*, one growing part of the answer —

- OpenAI chat and completions: the opening (chat's role chunk), ``content`` (completions'
  ``text``), ``reasoning``, and per tool call its head (id, type, name) and its arguments;
- Anthropic Messages: the opening (``message_start``), and per content block its start, its deltas
  (text, thinking or partial JSON), its signature and its stop;
- OpenAI Responses: each event type once (``response.created``, an item's ``added`` and
  ``done`` events, per output index and content or summary index), and each delta's text.

Text channels count characters, the others 1 once sent. Only choice 0 counts: a resumed stream
has one choice (``router/resume.py``).

A Responses stream also numbers its events and names each output item with an id vLLM makes per
request (``msg_…``, ``rs_…``, ``fc_…`` and a ``call_…``): the router sends the client's ids and its
next sequence number along (``ids``, ``received["sequence"]``), and the continuation's every event,
its terminal one and the response stored go out under the client's ids and numbers.
"""

import dataclasses
import json
import re
from collections import Counter
from typing import Any

from serve_app.telemetry.logs import module_logger
from serve_app.wire.sse import EVENT_END, data_event, named_event

logger = module_logger(__name__)

Received = dict[str, int]

_CREATED = re.compile(r'"created":\s*\d+,')  # vLLM's chunks: "created":<int>, before "model"
_REASONING_KEYS = ("reasoning", "reasoning_content")  # vLLM's name, and the older one clients read
_ANTHROPIC_TEXT = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}


class _OpenAIChunks:
    """Chat and completions chunks: ``data: {...}`` events."""

    @staticmethod
    def parse(event: str) -> Any:
        if not event.startswith("data: {"):
            return None
        return json.loads(event[6:])

    @staticmethod
    def frame(payload: dict[str, Any]) -> str:
        return data_event(payload)

    @staticmethod
    def count(payload: dict[str, Any], into: Counter) -> None:
        for choice in _first_choice(payload):
            if "text" in choice:
                into["content"] += len(choice["text"] or "")
            delta = choice.get("delta") or {}
            if "role" in delta:
                into["opening"] = 1
            into["content"] += len(delta.get("content") or "")
            into["reasoning"] += sum(len(delta.get(key) or "") for key in _REASONING_KEYS)
            for call in delta.get("tool_calls") or ():
                tool, function = f"tool{call.get('index', 0)}", call.get("function") or {}
                if call.get("id") or function.get("name"):
                    into[f"{tool}.head"] = 1
                into[f"{tool}.arguments"] += len(function.get("arguments") or "")

    @staticmethod
    def cut(payload: dict[str, Any], left: Counter) -> bool:
        """Take out of ``payload`` what ``left`` says the client has (and count it off); whether
        anything is left for the client."""
        choices = payload.get("choices")
        if not choices:
            return True  # the usage chunk: nothing of a channel in it
        for choice in _first_choice(payload):
            if "text" in choice:
                choice["text"] = _cut_text(choice["text"] or "", "content", left)
            delta = choice.get("delta")
            if not delta:
                continue
            if "role" in delta and _take_once("opening", left):
                del delta["role"]
            if delta.get("content"):
                delta["content"] = _cut_text(delta["content"], "content", left)
            for key in _REASONING_KEYS:
                if delta.get(key):
                    delta[key] = _cut_text(delta[key], "reasoning", left)
            if delta.get("tool_calls"):
                delta["tool_calls"] = [cut for call in delta["tool_calls"] if (cut := _cut_tool_call(call, left))]
        return any(_says_something(choice) for choice in choices if isinstance(choice, dict))


def _says_something(choice: dict[str, Any]) -> bool:
    """Whether a chunk's choice still carries anything: text, a delta field, a finish, logprobs."""
    if choice.get("text") or choice.get("finish_reason") or choice.get("logprobs"):
        return True
    return any((choice.get("delta") or {}).values())


def _first_choice(payload: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in payload.get("choices") or () if isinstance(c, dict) and c.get("index", 0) == 0]


def _cut_tool_call(call: dict[str, Any], left: Counter) -> dict[str, Any] | None:
    tool, function = f"tool{call.get('index', 0)}", dict(call.get("function") or {})
    call = {**call}
    if (call.get("id") or function.get("name")) and _take_once(f"{tool}.head", left):
        call.pop("id", None)
        call.pop("type", None)
        function.pop("name", None)
    if function.get("arguments"):
        function["arguments"] = _cut_text(function["arguments"], f"{tool}.arguments", left)
        if not function["arguments"]:
            del function["arguments"]
    if function:
        call["function"] = function
    else:
        call.pop("function", None)
    return call if set(call) - {"index"} else None


class _AnthropicEvents:
    """Anthropic Messages events: ``event: <name>\\ndata: {...}``."""

    @staticmethod
    def parse(event: str) -> Any:
        name, _, data = event.partition("\n")
        if not name.startswith("event: ") or not data.startswith("data: "):
            return None
        payload = json.loads(data[6:])
        return payload if isinstance(payload, dict) else None

    @staticmethod
    def frame(payload: dict[str, Any]) -> str:
        return named_event(payload.get("type", ""), payload)

    @staticmethod
    def count(payload: dict[str, Any], into: Counter) -> None:
        kind, block = payload.get("type"), f"block{payload.get('index', 0)}"
        if kind == "message_start":
            into["opening"] = 1
        elif kind == "content_block_start":
            into[f"{block}.start"] = 1
        elif kind == "content_block_stop":
            into[f"{block}.stop"] = 1
        elif kind == "content_block_delta":
            delta = payload.get("delta") or {}
            if delta.get("type") == "signature_delta":
                into[f"{block}.signature"] = 1
            elif (field := _ANTHROPIC_TEXT.get(delta.get("type"))) is not None:
                into[f"{block}.delta"] += len(delta.get(field) or "")

    @staticmethod
    def cut(payload: dict[str, Any], left: Counter) -> bool:
        kind, block = payload.get("type"), f"block{payload.get('index', 0)}"
        if kind == "message_start":
            return not _take_once("opening", left)
        if kind == "content_block_start":
            return not _take_once(f"{block}.start", left)
        if kind == "content_block_stop":
            return not _take_once(f"{block}.stop", left)
        if kind == "ping":
            return False  # the replay's: the client is not waiting on it
        if kind == "content_block_delta":
            delta = payload.get("delta") or {}
            if delta.get("type") == "signature_delta":
                return not _take_once(f"{block}.signature", left)
            if (field := _ANTHROPIC_TEXT.get(delta.get("type"))) is not None:
                delta[field] = _cut_text(delta.get(field) or "", f"{block}.delta", left)
                return bool(delta[field])
        return True


class _ResponsesEvents:
    """OpenAI Responses events: ``event: <type>\ndata: {...}``, each with its ``sequence_number``."""

    parse = _AnthropicEvents.parse
    frame = _AnthropicEvents.frame

    @staticmethod
    def channel(payload: dict[str, Any]) -> str:
        key = payload.get("type", "")
        for index in ("output_index", "content_index", "summary_index"):
            if index in payload:
                key += f":{payload[index]}"
        return key

    @staticmethod
    def count(payload: dict[str, Any], into: Counter) -> None:
        if isinstance(payload.get("sequence_number"), int):
            into["sequence"] = max(into["sequence"], payload["sequence_number"] + 1)
        channel = _ResponsesEvents.channel(payload)
        if channel.split(":", 1)[0].endswith(".delta"):
            into[channel] += len(payload.get("delta") or "")
        else:
            into[channel] = 1

    @staticmethod
    def cut(payload: dict[str, Any], left: Counter) -> bool:
        channel = _ResponsesEvents.channel(payload)
        if channel.split(":", 1)[0].endswith(".delta"):
            payload["delta"] = _cut_text(payload.get("delta") or "", channel, left)
            return bool(payload["delta"])
        return not _take_once(channel, left)


def _payloads(events, relayed: bytes):
    """The JSON object of each whole event in ``relayed``, as ``events`` parses its dialect."""
    for raw in relayed.split(EVENT_END):
        try:
            payload = events.parse(raw.decode("utf-8", "replace").lstrip("\n"))
        except ValueError:
            continue
        if isinstance(payload, dict):
            yield payload


def created(surface: str, relayed: bytes) -> int | None:
    """The ``created`` of a chat or completions stream's chunks the client has (None: another
    surface, or no chunk yet)."""
    if _BY_SURFACE.get(surface) is not _OpenAIChunks:
        return None
    for payload in _payloads(_OpenAIChunks, relayed):
        if type(stamp := payload.get("created")) is int:
            return stamp
    return None


def item_ids(relayed: bytes) -> dict[str, str]:
    """The ids of a Responses stream's output items the client has (``item<i>``, and ``call<i>``
    for a function call), by output index."""
    ids: dict[str, str] = {}
    for payload in _payloads(_ResponsesEvents, relayed):
        if payload.get("type") == "response.output_item.added":
            item, index = payload.get("item") or {}, payload.get("output_index")
            if isinstance(item.get("id"), str):
                ids[f"item{index}"] = item["id"]
            if isinstance(item.get("call_id"), str):
                ids[f"call{index}"] = item["call_id"]
    return ids


def _cut_text(text: str, channel: str, left: Counter) -> str:
    have = left.get(channel, 0)
    if not have:
        return text
    taken = min(have, len(text))
    _count_off(channel, taken, left)
    return text[taken:]


def _take_once(channel: str, left: Counter) -> bool:
    if not left.get(channel):
        return False
    _count_off(channel, 1, left)
    return True


def _count_off(channel: str, amount: int, left: Counter) -> None:
    left[channel] -= amount
    if left[channel] <= 0:
        del left[channel]


# The surfaces whose streams have a seam; every other surface's stream is not resumed.
_BY_SURFACE = {"chat": _OpenAIChunks, "completions": _OpenAIChunks, "messages": _AnthropicEvents,
               "responses": _ResponsesEvents}
SURFACES = frozenset(_BY_SURFACE)
# A received mapping is small: a few channels per tool call or content block.
MAX_CHANNELS = 512


def received(surface: str, relayed: bytes) -> Received:
    """What the client has of a ``surface`` stream whose bytes so far were ``relayed``."""
    events, into = _BY_SURFACE[surface], Counter()
    for payload in _payloads(events, relayed):
        events.count(payload, into)
    return {channel: n for channel, n in into.items() if n > 0}


def valid_received(value: Any) -> bool:
    """A received mapping as a peer region's router may send it (``router/resume.py``)."""
    return (isinstance(value, dict) and len(value) <= MAX_CHANNELS
            and all(isinstance(k, str) and len(k) <= 64 and type(n) is int and 0 < n < 2**31 for k, n in value.items()))


def valid_ids(value: Any) -> bool:
    """Item ids as a peer region's router may send them."""
    return (isinstance(value, dict) and len(value) <= MAX_CHANNELS
            and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 128 for k, v in value.items()))


def _still_cutting(left: Counter, past_seam) -> bool:
    """Whether the client still has something the continuation would send again. Past the seam
    (the engine's own output is flowing) nothing is cut: if the replay fell short of what the
    client had (it should not), the rest passes rather than being swallowed, and the log says so."""
    if left and past_seam():
        logger.warning("a resumed stream's replay did not cover what its client had: %s", dict(left))
        left.clear()
    return bool(left)


class Cut:
    """A continuation's events on their way out of the replica: what the client has is cut out,
    then ``watcher`` (the surface's own, which reads usage, timing and the end) sees the rest.

    Cutting stops once the client's channels are all counted off, or once the continuation is
    past its seam (``_still_cutting``)."""

    def __init__(self, surface: str, client_has: Received, watcher: Any, past_seam, created: int | None = None):
        self.watcher = watcher
        self._events = _BY_SURFACE[surface]
        self._left = Counter(client_has)
        self._past_seam = past_seam
        # The first call's ``created`` (``Resume.created``), on every chunk that carries one.
        self._created = f'"created":{created},' if created is not None else None

    def pass_on(self, event: str) -> str | None:
        if _still_cutting(self._left, self._past_seam):
            payload = self._events.parse(event)
            if isinstance(payload, dict):
                if not self._events.cut(payload, self._left):
                    return None
                event = self._events.frame(payload)
        if self._created is not None and '"created":' in event:
            event = _CREATED.sub(self._created, event, count=1)
        return self.watcher.pass_on(event)

    def refusal(self, first: Any):
        return self.watcher.refusal(first)

    def trailer(self):
        return self.watcher.trailer()


class ResponsesCut:
    """A Responses continuation's events on their way out: the surface's watcher first (it turns
    vLLM's event objects into frames and holds the terminal event back), then the cut, as
    ``Cut``'s, and — for every event to the end — the client's item ids and the stream's numbering."""

    def __init__(self, client_has: Received, ids: dict[str, str], watcher: Any, past_seam):
        self.watcher = watcher
        self._left = Counter(client_has)
        self._next = self._left.pop("sequence", 0)
        self._ids = ids
        self._past_seam = past_seam

    def pass_on(self, event: Any) -> str | None:
        frame = self.watcher.pass_on(event)
        if frame is None:
            return None
        payload = _ResponsesEvents.parse(frame)
        if not isinstance(payload, dict):
            return frame
        if _still_cutting(self._left, self._past_seam) and not _ResponsesEvents.cut(payload, self._left):
            return None
        self._as_the_clients(payload)
        return _ResponsesEvents.frame(payload)

    def refusal(self, first: Any):
        return self.watcher.refusal(first)

    def trailer(self):
        trailer = self.watcher.trailer()
        if trailer.terminal is None:
            return trailer
        terminal = {**trailer.terminal, "response": {**trailer.terminal["response"]}}
        self._as_the_clients(terminal)
        response = terminal["response"]
        response["output"] = [self._item_as_the_clients(i, dict(item)) for i, item in enumerate(response.get("output") or ())]
        return dataclasses.replace(trailer, terminal=terminal, response=response)

    def _as_the_clients(self, payload: dict[str, Any]) -> None:
        payload["sequence_number"], self._next = self._next, self._next + 1
        index = payload.get("output_index")
        if index is None or f"item{index}" not in self._ids:
            return
        if "item_id" in payload:
            payload["item_id"] = self._ids[f"item{index}"]
        if isinstance(payload.get("item"), dict):
            payload["item"] = self._item_as_the_clients(index, dict(payload["item"]))

    def _item_as_the_clients(self, index: int, item: dict[str, Any]) -> dict[str, Any]:
        if f"item{index}" in self._ids and "id" in item:
            item["id"] = self._ids[f"item{index}"]
        if f"call{index}" in self._ids and "call_id" in item:
            item["call_id"] = self._ids[f"call{index}"]
        return item


def as_first_told(trailer: Any, limit: Any, first: dict[str, Any] | None) -> Any:
    """A resumed Responses stream's trailer with its terminal event and stored response saying
    what the stream's first events told the client: the limit its request had (the continuation
    was given what was left of it) and the ``created_at`` of ``response.created``."""
    if trailer.terminal is None or not isinstance(trailer.terminal.get("response"), dict):
        return trailer
    response = {**trailer.terminal["response"], "max_output_tokens": limit}
    created = ((first or {}).get("response") or {}).get("created_at")
    if created is not None:
        response["created_at"] = created
    return dataclasses.replace(trailer, terminal={**trailer.terminal, "response": response}, response=response)

