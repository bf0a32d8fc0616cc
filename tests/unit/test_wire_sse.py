"""wire/sse.py: the one place SSE frames are written and read, by the replica's shaping, the
router's relay and a peer's stream reader alike."""

import pytest

from serve_app.wire import sse


def test_a_named_frame_reads_back_as_its_name_and_json():
    frame = sse.named_event("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}})
    assert frame == 'event: message_delta\ndata: {"delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":3}}\n\n'
    assert sse.name_of(frame) == "message_delta"
    assert sse.json_of(frame) == {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}}
    assert sse.json_of(frame.encode()) == sse.json_of(frame)  # a peer's bytes, as read off the wire


def test_json_already_encoded_is_framed_as_it_is():
    frame = sse.named_frame("response.output_text.delta", '{"type": "response.output_text.delta", "delta": "hi"}')
    assert frame == 'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "delta": "hi"}\n\n'
    assert sse.json_of(frame)["delta"] == "hi"


def test_an_unnamed_frame_has_no_name_and_its_data_is_its_json():
    frame = sse.data_event({"choices": [{"delta": {"content": "x"}}]})
    assert sse.name_of(frame) is None
    assert sse.json_of(frame) == {"choices": [{"delta": {"content": "x"}}]}
    assert sse.name_of("event: ping") == "ping"  # a name alone, no newline yet


@pytest.mark.parametrize("frame", [": keep-alive\n\n", "event: ping\n\n", "data: [DONE]\n\n", b"data: {bad\n\n"])
def test_a_frame_without_json_data_is_a_value_error(frame):
    with pytest.raises(ValueError):
        sse.json_of(frame)
    if isinstance(frame, str):
        assert sse.data_of(frame) is None  # the lenient reader of any client's frames
