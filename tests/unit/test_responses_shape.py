"""Responses bodies and stream events, built from vLLM 0.32's own protocol objects and stream
emitters (no engine), fail OpenAI's schema and Open Responses as vLLM dumps them and pass both once
shaped (``validate_responses``: tests/data/schemas/README.md says where the two disagree).

A vLLM upgrade that adds a field or fixes one shows up here: either a "fails before" assertion
breaks (vLLM fixed it; the fix here may go) or a "passes after" one does (a new null to drop).
"""

import copy
import json

import pytest
from openai.types.responses import (
    Response,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseStreamEvent,
)
from openai.types.responses.response_reasoning_item import Content as ReasoningText
from pydantic import TypeAdapter
from vllm.entrypoints.openai.responses import streaming_events as emit
from vllm.entrypoints.openai.responses.protocol import (
    InputTokensDetails,
    OutputTokensDetails,
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseInProgressEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)

from serve_app.engine import responses_shape, trailer
from tests.schema_validation import errors, validate_responses

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
PLAIN = {"model": "m", "input": "hi"}
WITH_TOOLS = {"model": "m", "input": "weather?", "tools": [TOOL], "reasoning": {"effort": "low"}}


def text_item():
    part = ResponseOutputText(type="output_text", text="Hello", annotations=[], logprobs=None)
    return ResponseOutputMessage(id="msg_1", type="message", role="assistant", status="completed", content=[part])


def reasoning_item():
    # As vLLM's build_response_output_items makes it (status None).
    content = [ReasoningText(type="reasoning_text", text="The user wants weather.")]
    return ResponseReasoningItem(id="rs_1", type="reasoning", summary=[], content=content, status=None)


def call_item():
    return ResponseFunctionToolCall(
        id="fc_1",
        call_id="call_1",
        type="function_call",
        status="completed",
        name="get_weather",
        namespace=None,
        arguments="{}",
    )


def vllm_response(request=PLAIN, output=None, status="completed", **fields):
    """A Responses body as vLLM's router dumps it (``model_dump(mode="json", by_alias=True)``)."""
    req = ResponsesRequest.model_validate(copy.deepcopy(request))  # vLLM edits the dict it is given
    usage = ResponseUsage(
        input_tokens=3,
        output_tokens=5,
        total_tokens=8,
        input_tokens_details=InputTokensDetails(cached_tokens=1, cache_write_tokens=0),
        output_tokens_details=OutputTokensDetails(reasoning_tokens=2),
    )
    response = ResponsesResponse.from_request(
        req,
        req.to_sampling_params(100, {}),
        model_name="m",
        created_time=1700000000,
        output=[text_item()] if output is None else output,
        status=status,
        usage=usage,
        **fields,
    )
    return response.model_dump(mode="json", by_alias=True)


def shaped(body, request=PLAIN):
    trailer.from_response(body)  # the replica takes `metrics` off first
    return responses_shape.response(body, request)


BODIES = {
    "text": lambda: vllm_response(),
    "reasoning": lambda: vllm_response(WITH_TOOLS, [reasoning_item(), text_item()]),
    "function_call": lambda: vllm_response(WITH_TOOLS, [reasoning_item(), call_item()]),
    "incomplete": lambda: vllm_response(PLAIN, [text_item()], status="incomplete"),
}


@pytest.mark.parametrize("kind", BODIES)
def test_vllm_body_fails_the_schema_and_passes_once_shaped(kind):
    body = BODIES[kind]()
    before = errors("openai", "Response", body)
    assert "$: 'error' is a required property" in before
    assert "$.user: None is not of type 'string'" in before
    request = PLAIN if kind in ("text", "incomplete") else WITH_TOOLS
    validate_responses(shaped(body, request))
    Response.model_validate(body)  # and the SDK reads it


def test_vllm_body_lacks_the_identifiers_open_responses_requires_and_gets_them_null_or_echoed():
    before = errors("openresponses", "ResponseResource", vllm_response())
    assert "$: 'safety_identifier' is a required property" in before
    assert "$: 'prompt_cache_key' is a required property" in before
    body = shaped(vllm_response())
    assert body["safety_identifier"] is None and body["prompt_cache_key"] is None
    sent = {**PLAIN, "safety_identifier": "u-1", "prompt_cache_key": "k-1"}
    echoed = shaped(vllm_response(sent), sent)
    assert echoed["safety_identifier"] == "u-1" and echoed["prompt_cache_key"] == "k-1"
    validate_responses(echoed)
    assert Response.model_validate(echoed).safety_identifier == "u-1"  # and the SDK reads them


def test_each_item_kind_fails_before_shaping_where_vllm_leaves_nulls():
    before = errors("openai", "Response", vllm_response(WITH_TOOLS, [reasoning_item(), text_item(), call_item()]))
    assert "$.output[0].status: None is not of type 'string'" in before  # reasoning
    assert "$.output[1].content[0].logprobs: None is not of type 'array'" in before  # output_text
    assert "$.output[2].namespace: None is not of type 'string'" in before  # function_call
    assert "$.tools[0].defer_loading: None is not of type 'boolean'" in before


def test_shaped_text_body_is_what_openai_sends():
    body = shaped(vllm_response())
    assert body["error"] is None and isinstance(body["completed_at"], int) and body["completed_at"] > 1700000000
    assert body["store"] is True  # the API's default
    assert body["text"] == {"format": {"type": "text"}}
    assert body["top_logprobs"] == 0 and body["metadata"] == {}
    assert body["reasoning"] == {"effort": None, "summary": None}
    assert body["tool_choice"] == "auto"  # vLLM says "none" when there are no tools
    assert body["service_tier"] == "default"
    assert body["output"][0] == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}],
    }
    assert body["usage"] == {
        "input_tokens": 3,
        "input_tokens_details": {"cached_tokens": 1, "cache_write_tokens": 0},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 8,
    }
    for extra in ("kv_transfer_params", "ec_transfer_params", "input_messages", "output_messages", "metrics", "user"):
        assert extra not in body
    # Required (or always sent) and null: present as null.
    for key in ("incomplete_details", "instructions", "previous_response_id", "max_tool_calls"):
        assert key in body and body[key] is None
    json.dumps(body)


def test_incomplete_body_has_no_completed_at_and_keeps_its_reason():
    body = shaped(BODIES["incomplete"]())
    assert body["completed_at"] is None and body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_items_lose_the_nulls_the_spec_forbids_and_tools_keep_the_required_ones():
    body = shaped(BODIES["function_call"](), WITH_TOOLS)
    reasoning, call = body["output"]
    assert reasoning == {
        "id": "rs_1",
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "The user wants weather."}],
    }
    assert call == {
        "id": "fc_1",
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": "{}",
        "status": "completed",
    }
    # A function tool requires `strict` and `parameters` (OpenAI) and `description` (Open
    # Responses), nullable: they stay, as null.
    assert body["tools"] == [{**TOOL, "strict": None, "description": None}]
    assert body["reasoning"] == {"effort": "low", "summary": None}  # vLLM's context/mode dropped


def test_the_request_is_echoed_where_openai_echoes_it():
    request = {
        **WITH_TOOLS,
        "store": False,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "service_tier": "priority",
        "metadata": {"team": "a"},
        "top_logprobs": 3,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}, "verbosity": "low"},
    }
    body = shaped(vllm_response(request), request)
    validate_responses(body)
    assert body["store"] is False
    assert body["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert body["service_tier"] == "priority"
    assert body["metadata"] == {"team": "a"} and body["top_logprobs"] == 3
    # vLLM's inner nulls are gone, but for the two Open Responses requires (`description` null,
    # `strict` OpenAI's default); `schema` is spelled as the spec has it.
    json_schema = {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "description": None, "strict": False}
    assert body["text"] == {"format": json_schema, "verbosity": "low"}


def test_vllm_rewrites_tool_choice_in_the_dict_it_validates():
    """Why ``request`` must be the client's body as sent, kept apart from the dict vLLM validates:
    vLLM's before-validator writes its own ``tool_choice`` into it."""
    sent = {"model": "m", "input": "hi"}
    ResponsesRequest.model_validate(sent)
    assert sent["tool_choice"] == "none"


def test_service_tier_auto_reports_the_tier_used():
    body = shaped(vllm_response({**PLAIN, "service_tier": "auto"}), {**PLAIN, "service_tier": "auto"})
    assert body["service_tier"] == "default"


def test_requested_vllm_extras_are_kept_and_leftover_metrics_dropped():
    body = vllm_response(kv_transfer_params={"remote": 1}, ec_transfer_params={"ec": 2})
    body["metrics"] = {"queue_time_ms": 1.0}  # not popped by the caller this time
    kept = responses_shape.response(copy.deepcopy(body), {**PLAIN, "kv_transfer_params": {}, "ec_transfer_params": {}})
    assert kept["kv_transfer_params"] == {"remote": 1} and kept["ec_transfer_params"] == {"ec": 2}
    assert "metrics" not in kept
    dropped = responses_shape.response(body, PLAIN)
    assert "kv_transfer_params" not in dropped and "ec_transfer_params" not in dropped


def test_response_messages_are_kept_when_enabled():
    body = vllm_response()
    body["input_messages"] = [{"role": "user", "content": "hi"}]
    request = {**PLAIN, "enable_response_messages": True}
    kept = responses_shape.response(copy.deepcopy(body), request)
    assert kept["input_messages"] == [{"role": "user", "content": "hi"}]
    assert "input_messages" not in responses_shape.response(body, PLAIN)


def test_shaping_twice_changes_nothing_more():
    once = shaped(BODIES["function_call"](), WITH_TOOLS)
    assert responses_shape.response(copy.deepcopy(once), WITH_TOOLS) == once


# --- stream ---------------------------------------------------------------------------------


def vllm_stream(request=WITH_TOOLS, status="completed"):
    """A whole stream as vLLM's non-Harmony generator yields it (reasoning, text, a tool call),
    each event dumped as the replica dumps it."""
    req = ResponsesRequest.model_validate(copy.deepcopy(request))
    params = req.to_sampling_params(100, {})
    initial = ResponsesResponse.from_request(
        req, params, model_name="m", created_time=1, output=[], status="in_progress", usage=None
    ).model_dump(mode="json", by_alias=True)
    state = emit.SimpleStreamingState()
    events = [
        ResponseCreatedEvent(type="response.created", sequence_number=-1, response=initial),
        ResponseInProgressEvent(type="response.in_progress", sequence_number=-1, response=initial),
        *emit.emit_simple_reasoning_open(state),
        *emit.emit_simple_reasoning_delta(state, "Weather, "),
        *emit.emit_simple_reasoning_delta(state, "so a tool."),
        *emit.emit_simple_reasoning_done(state),
        *emit.emit_simple_content_open(state),
        *emit.emit_simple_content_delta(state, "Let me "),
        *emit.emit_simple_content_delta(state, "check."),
        *emit.emit_simple_content_done(state),
        *emit.emit_simple_tool_call_open(state, "get_weather", 0),
        *emit.emit_simple_tool_call_delta(state, '{"city":'),
        *emit.emit_simple_tool_call_delta(state, '"SF"}'),
        *emit.emit_simple_tool_call_done(state),
    ]
    final = ResponsesResponse.from_request(
        req, params, model_name="m", created_time=1, output=[reasoning_item(), text_item(), call_item()], status=status
    )
    events.append(ResponseCompletedEvent(type="response.completed", sequence_number=-1, response=final))
    for number, event in enumerate(events):
        event.sequence_number = number
    return [event.model_dump(mode="json", by_alias=True) for event in events]


ALL_KINDS = {
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.output_item.done",
    "response.content_part.added",
    "response.content_part.done",
    "response.output_text.delta",
    "response.output_text.done",
    "response.reasoning_text.delta",
    "response.reasoning_text.done",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.completed",
}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def test_every_vllm_stream_event_validates_once_shaped():
    events = vllm_stream()
    assert {event["type"] for event in events} == ALL_KINDS
    failing = {event["type"] for event in events if errors("openai", "ResponseStreamEvent", event)}
    # What vLLM gets wrong: every response (nulls, no `error`), the reasoning item it opens
    # (`content: null`), a finished text part (`logprobs: null`), every function call (`namespace`).
    assert failing == {
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.output_item.done",
        "response.content_part.done",
        "response.completed",
    }
    for event in events:
        out = responses_shape.stream_event(event, WITH_TOOLS)
        validate_responses(out, event=True)
        STREAM_EVENT.validate_python(out)  # and the SDK reads it


def test_response_events_get_the_body_fixes():
    created, in_progress = (responses_shape.stream_event(e, WITH_TOOLS) for e in vllm_stream()[:2])
    for event in (created, in_progress):
        response = event["response"]
        assert response["status"] == "in_progress" and response["completed_at"] is None
        assert response["error"] is None and response["usage"] is None  # required; null until the end
        assert response["tool_choice"] == "auto" and response["store"] is True


@pytest.mark.parametrize(
    "status, kind",
    [("completed", "response.completed"), ("incomplete", "response.incomplete"), ("failed", "response.failed")],
)
def test_terminal_event_is_named_by_the_response_status(status, kind):
    last = responses_shape.stream_event(vllm_stream(status=status)[-1], WITH_TOOLS)
    assert last["type"] == kind and last["response"]["status"] == status
    validate_responses(last, event=True)
    assert responses_shape.sse(last).startswith(f"event: {kind}\ndata: ")
    if status == "completed":
        assert isinstance(last["response"]["completed_at"], int)
    else:
        assert last["response"]["completed_at"] is None


class NoWalk(dict):
    """An event that fails the test if anything iterates it (a deep walk or a JSON encode)."""

    def __iter__(self):
        raise AssertionError("walked a delta")

    def items(self):
        raise AssertionError("walked a delta")

    def values(self):
        raise AssertionError("walked a delta")


@pytest.mark.parametrize(
    "kind", ["response.output_text.delta", "response.reasoning_text.delta", "response.function_call_arguments.delta"]
)
def test_deltas_come_back_unchanged_without_a_walk(kind):
    (event,) = [event for event in vllm_stream() if event["type"] == kind][:1]
    before = copy.deepcopy(event)
    assert responses_shape.stream_event(event, WITH_TOOLS) is event and event == before
    guarded = NoWalk(event)
    assert responses_shape.stream_event(guarded, WITH_TOOLS) is guarded


@pytest.mark.parametrize("kind, key", [("response.output_text.delta", "delta"), ("response.output_text.done", "text")])
@pytest.mark.parametrize("logprobs", ["missing", None])
def test_output_text_events_get_their_required_logprobs(kind, key, logprobs):
    event = {"type": kind, "item_id": "msg_1", "output_index": 0, "content_index": 0, key: "Hi", "sequence_number": 3}
    if logprobs is None:
        event["logprobs"] = None
    assert errors("openai", "ResponseStreamEvent", event)
    out = responses_shape.stream_event(event, PLAIN)
    assert out["logprobs"] == []
    validate_responses(out, event=True)


def test_output_text_delta_keeps_its_logprobs():
    logprobs = [{"token": "Hi", "logprob": -0.2, "top_logprobs": [{"token": "Hi", "logprob": -0.2}]}]
    event = {"type": "response.output_text.delta", "item_id": "m", "output_index": 0, "content_index": 0}
    event.update(delta="Hi", sequence_number=1, logprobs=logprobs)
    assert responses_shape.stream_event(event, PLAIN)["logprobs"] is logprobs


def test_an_error_event_gets_its_required_code_and_param_and_the_error_object():
    event = {"type": "error", "message": "the model engine failed", "sequence_number": 9}
    assert errors("openai", "ResponseStreamEvent", event)
    assert errors("openresponses", "ResponseStreamingEvent", event)
    out = responses_shape.stream_event(event, PLAIN)
    validate_responses(out, event=True)
    assert out["error"] == {"type": "server_error", "code": None, "message": "the model engine failed", "param": None}


def test_sse_frame_is_named_by_type_and_compact():
    event = {"type": "response.output_text.delta", "delta": "é", "sequence_number": 1}
    frame = responses_shape.sse(event)
    data = '{"type":"response.output_text.delta","delta":"\\u00e9","sequence_number":1}'
    assert frame == f"event: response.output_text.delta\ndata: {data}\n\n"
    assert json.loads(frame.split("data: ", 1)[1]) == event
