"""A resumed stream's seam (``surfaces/seam.py``): the router counts what the client has from the
bytes it relayed, the replica cuts that out of the continuation's replay — whatever the chunks'
grouping on either side, the client ends with every channel whole, nothing twice."""

import json
import logging

import pytest

from serve_app.surfaces import seam


def _chat(delta=None, finish=None, text=None):
    choice = {"index": 0, "logprobs": None, "finish_reason": finish}
    if text is not None:
        choice["text"] = text
    else:
        choice["delta"] = delta or {}
    return "data: " + json.dumps({"id": "chatcmpl-1", "choices": [choice]}, separators=(",", ":")) + "\n\n"


def _call(index, arguments, head=False):
    call = {"index": index, "function": {"arguments": arguments}}
    if head:
        call.update(id=f"call_{index}", type="function")
        call["function"]["name"] = f"tool_{index}"
    return {"tool_calls": [call]}


# One answer: reasoning, then content, then two tool calls, as a parser streams it.
REASONING, CONTENT = "Let me think about the file.", "I will edit it."
ARGS = ['{"path": "a.py", "text": "déjà vu"}', '{"n": 2}']


def _answer(step):
    """The answer's chunks, each channel in pieces of ``step`` characters (a grouping)."""
    events = [_chat({"role": "assistant", "content": ""})]
    events += [_chat({"reasoning": REASONING[i:i + step]}) for i in range(0, len(REASONING), step)]
    events += [_chat({"content": CONTENT[i:i + step]}) for i in range(0, len(CONTENT), step)]
    for index, arguments in enumerate(ARGS):
        events.append(_chat(_call(index, "", head=True)))
        events += [_chat(_call(index, arguments[i:i + step])) for i in range(0, len(arguments), step)]
    return events


def _whole(events):
    """What a client assembles from chat chunks: role count, reasoning, content, tool calls."""
    roles, reasoning, content, calls = 0, "", "", {}
    for event in events:
        for choice in json.loads(event[6:])["choices"]:
            delta = choice.get("delta") or {}
            roles += "role" in delta
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                entry = calls.setdefault(call["index"], {"heads": 0, "arguments": ""})
                entry["heads"] += "id" in call
                entry["arguments"] += call.get("function", {}).get("arguments", "")
    return roles, reasoning, content, calls


FULL = _whole(_answer(1))


@pytest.mark.parametrize("client_step, replay_step", [(1, 1), (3, 1), (1, 4), (7, 2)])
def test_a_chat_continuation_sends_only_what_the_client_lacks_at_any_seam(client_step, replay_step):
    first, replay = _answer(client_step), _answer(replay_step)
    for seam_at in range(len(first) + 1):  # the first stream broke after any of its chunks
        client = first[:seam_at]
        received = seam.received("chat", "".join(client).encode())
        cut = seam.Cut("chat", received, _PassOn(), lambda: False)
        sent = [out for event in replay if (out := cut.pass_on(event)) is not None]
        assert _whole(client + sent) == FULL, seam_at


def test_a_completions_continuation_cuts_the_text_the_client_has():
    first = [_chat(text="Hello"), _chat(text=" wor")]
    cut = seam.Cut("completions", seam.received("completions", "".join(first).encode()), _PassOn(), lambda: False)
    sent = [out for e in (_chat(text="Hel"), _chat(text="lo world"), _chat(text="!", finish="length")) if (out := cut.pass_on(e))]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in sent] == ["ld", "!"]


def _anthropic(payload):
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"


def _messages(step):
    events = [_anthropic({"type": "message_start", "message": {"id": "msg_1", "usage": {"input_tokens": 5}}})]
    blocks = [("thinking", "thinking_delta", "thinking", REASONING), ("text", "text_delta", "text", CONTENT),
              ("tool_use", "input_json_delta", "partial_json", ARGS[0])]
    for index, (kind, delta_type, field, text) in enumerate(blocks):
        events.append(_anthropic({"type": "content_block_start", "index": index, "content_block": {"type": kind}}))
        events += [_anthropic({"type": "content_block_delta", "index": index,
                               "delta": {"type": delta_type, field: text[i:i + step]}}) for i in range(0, len(text), step)]
        if kind == "thinking":
            events.append(_anthropic({"type": "content_block_delta", "index": index,
                                      "delta": {"type": "signature_delta", "signature": "s1"}}))
        events.append(_anthropic({"type": "content_block_stop", "index": index}))
    return events


def _assembled(events):
    starts, stops, signatures, texts, opening = {}, {}, {}, {}, 0
    for event in events:
        payload = json.loads(event.split("data: ", 1)[1])
        kind, index = payload["type"], payload.get("index")
        opening += kind == "message_start"
        if kind == "content_block_start":
            starts[index] = starts.get(index, 0) + 1
        elif kind == "content_block_stop":
            stops[index] = stops.get(index, 0) + 1
        elif kind == "content_block_delta":
            delta = payload["delta"]
            if delta["type"] == "signature_delta":
                signatures[index] = signatures.get(index, 0) + 1
            else:
                texts[index] = texts.get(index, "") + next(v for k, v in delta.items() if k != "type")
    return opening, starts, stops, signatures, texts


@pytest.mark.parametrize("client_step, replay_step", [(1, 1), (5, 2)])
def test_a_messages_continuation_sends_only_what_the_client_lacks_at_any_seam(client_step, replay_step):
    first, replay = _messages(client_step), _messages(replay_step)
    whole = _assembled(_messages(1))
    for seam_at in range(len(first) + 1):
        client = first[:seam_at]
        cut = seam.Cut("messages", seam.received("messages", "".join(client).encode()), _PassOn(), lambda: False)
        sent = [out for event in replay if (out := cut.pass_on(event)) is not None]
        assert _assembled(client + sent) == whole, seam_at


def _responses_events(step, item_id):
    """A Responses stream's events (reasoning item, message item), deltas in pieces of ``step``."""
    events = [{"type": "response.created"}, {"type": "response.in_progress"}]
    for index, (kind, delta_type, text) in enumerate((("reasoning", "response.reasoning_text.delta", REASONING),
                                                       ("message", "response.output_text.delta", CONTENT))):
        item = {"id": f"{item_id}{index}", "type": kind}
        events.append({"type": "response.output_item.added", "output_index": index, "item": item})
        events.append({"type": "response.content_part.added", "output_index": index, "content_index": 0,
                       "item_id": item["id"]})
        events += [{"type": delta_type, "output_index": index, "content_index": 0, "item_id": item["id"],
                    "delta": text[i:i + step]} for i in range(0, len(text), step)]
        events.append({"type": "response.output_item.done", "output_index": index, "item": {**item, "text": text}})
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]


class _Frames:
    """The Responses watcher's part: an event object in, its frame out."""

    def pass_on(self, event):
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def test_a_responses_continuation_keeps_the_clients_ids_and_numbering_at_any_seam():
    first, replay = _responses_events(3, "msg_first"), _responses_events(1, "msg_replay")
    whole = _responses_events(1, "msg_first")
    for seam_at in range(len(first) + 1):
        frames = [_Frames().pass_on(e) for e in first[:seam_at]]
        relayed = "".join(frames).encode()
        cut = seam.ResponsesCut(seam.received("responses", relayed), seam.item_ids(relayed), _Frames(), lambda: False)
        sent = [json.loads(out.split("data: ", 1)[1]) for event in replay if (out := cut.pass_on(event)) is not None]
        got = first[:seam_at] + sent
        assert [e["sequence_number"] for e in got] == list(range(len(got))), seam_at
        for kind in ("response.reasoning_text.delta", "response.output_text.delta"):
            assert "".join(e["delta"] for e in got if e["type"] == kind) == "".join(
                e["delta"] for e in whole if e["type"] == kind), seam_at
        assert [e["type"] for e in got if not e["type"].endswith(".delta")] == [
            e["type"] for e in whole if not e["type"].endswith(".delta")], seam_at
        # Items the client had keep its ids; only ones it never saw carry the continuation's.
        for event in sent:
            index, named = event.get("output_index"), event.get("item_id") or (event.get("item") or {}).get("id")
            if named is not None:
                assert named == (f"msg_first{index}" if f"item{index}" in seam.item_ids(relayed) else f"msg_replay{index}")


def test_past_the_seam_nothing_is_cut_even_if_the_replay_fell_short(caplog):
    """The replay should always cover what the client has; if it did not, the engine's own
    output passes whole (and the log says so) rather than being swallowed."""
    caplog.set_level(logging.WARNING)
    past = []
    cut = seam.Cut("chat", {"content": 10}, _PassOn(), lambda: bool(past))
    assert cut.pass_on(_chat({"content": "abcd"})) is None  # the client has it: 6 characters still owed to the cut
    past.append(True)
    assert json.loads(cut.pass_on(_chat({"content": "new"}))[6:])["choices"][0]["delta"] == {"content": "new"}
    assert "did not cover" in caplog.text


@pytest.mark.parametrize("value, valid", [
    ({"content": 3, "tool0.head": 1}, True), ({}, True), ([], False), ({"content": -1}, False),
    ({"content": 1.5}, False), ({"content": True}, False), ({"x" * 65: 1}, False),
    ({f"c{i}": 1 for i in range(seam.MAX_CHANNELS + 1)}, False),
])
def test_a_received_mapping_from_a_peer_is_checked(value, valid):
    assert seam.valid_received(value) is valid


class _PassOn:
    """The surface's own watcher, which passes what it is given."""

    def pass_on(self, event):
        return event

    def trailer(self):
        return None
