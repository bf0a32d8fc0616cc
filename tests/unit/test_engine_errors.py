"""vLLM's words for a server fault never reach a client (serve_app/engine/vllm_engine.py):
its exception text is logged, and the client reads ours. The attack: an ``image_url`` naming
an internal host and port, answered with vLLM's 500 "Cannot connect to host 10.0.0.5:6379 …"
or a timeout — a port scanner through the error text. A client's own mistake (4xx) keeps
vLLM's message, which says what to fix."""

import asyncio
import logging

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.exceptions import GenerationError, RetryableRequestError, VLLMValidationError

from serve_app.config import ModelDeploymentArgs
from serve_app.engine import outputs as surfaces
from serve_app.engine.vllm_engine import VLLMEngine

BODY = {"model": "qwen-3.6-35b-a3b", "messages": [{"role": "user", "content": "hi"}]}
INTERNAL = "Cannot connect to host 10.0.0.5:6379 ssl:default [Connect call failed ('10.0.0.5', 6379)]"


def answer(fault):
    """What the replica answers when vLLM's serving call raises ``fault`` (an exception) or
    returns it (an ``ErrorResponse``)."""

    async def create(request, raw_request):
        if isinstance(fault, BaseException):
            raise fault
        return fault

    engine = VLLMEngine(ModelDeploymentArgs(id="qwen-3.6-35b-a3b"), "/weights")
    return asyncio.run(engine._run(ChatCompletionRequest, create, dict(BODY), surfaces.CHAT))


@pytest.mark.parametrize(
    "fault, status, code",
    [
        (ConnectionRefusedError(INTERNAL), 500, "internal"),  # a media fetch from inside the cluster
        (TimeoutError(f"fetching http://10.0.0.5:6379/ timed out; {INTERNAL}"), 500, "internal"),
        (RuntimeError(f'{INTERNAL}\n  File "/opt/venv/lib/python3.11/site-packages/vllm/x.py", line 3'), 500, "internal"),
        (GenerationError(f"Internal server error: {INTERNAL}"), 500, "internal"),
        (NotImplementedError(f"Qwen3NextForCausalLM.embed_multimodal: {INTERNAL}"), 501, "not_implemented"),
        (RetryableRequestError(f"KV transfer from 10.0.0.5 failed: {INTERNAL}"), 503, None),
        (create_error_response(RuntimeError(INTERNAL)), 500, "internal"),  # returned, not raised
    ],
)
def test_a_server_faults_text_is_logged_never_answered(fault, status, code, caplog):
    caplog.set_level(logging.ERROR)
    result = answer(fault)
    assert result.status == status
    error = result.body["error"]
    assert error["code"] == code and error["param"] is None
    assert "10.0.0.5" not in str(result.body) and "/opt/" not in str(result.body)
    assert "10.0.0.5" in caplog.text  # for the operators, with the request id Serve stamps on it


def test_a_503_still_says_retry_so_the_router_may_fail_over():
    assert answer(RetryableRequestError("busy")).body["error"]["message"].endswith("; retry")


@pytest.mark.parametrize(
    "fault, param",
    [
        (VLLMValidationError("'max_tokens' must be at least 1, got 0", parameter="max_tokens"), "max_tokens"),
        (ValueError("The URL must be from one of the allowed domains: ['cdn.example.com']."), None),
    ],
)
def test_a_clients_mistake_keeps_vllms_message(fault, param):
    result = answer(fault)
    assert result.status == 400
    assert result.body["error"]["message"] == str(fault)  # as vLLM's own server words it
    assert result.body["error"]["param"] == param


@pytest.mark.parametrize("param", ["input_tokens", "input_text"])
def test_a_prompt_over_the_context_names_the_clients_prompt_field_not_vllms(param):
    over = VLLMValidationError("This model's maximum context length is 8192 tokens. However, your request has "
                               "8193 input tokens.", parameter=param, value=8193)
    result = answer(over)
    error = result.body["error"]
    assert result.status == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"  # BODY's prompt field; `prompt` and `input` on their routes
    assert "parameter=" not in error["message"] and error["message"].startswith("This model's maximum context")


def _messages_stream_error(status: int, message: str, caplog) -> tuple[str, dict]:
    """A Messages stream whose chat stream underneath fails with vLLM's ``status``/``message``:
    the error event the client reads, and the trailer."""
    import json

    async def chat_events():
        yield f"data: {json.dumps({'error': {'message': message, 'type': 'x', 'param': None, 'code': status}})}\n\n"

    async def drain(stream):
        async for _ in surfaces.peek_chat_metrics(chat_events(), stream):
            pass

    caplog.set_level(logging.ERROR)
    stream = surfaces.MessagesStream({"model": "qwen-3.6-35b-a3b"})
    asyncio.run(drain(stream))
    # vLLM's Anthropic converter words it again as an internal_error event of its own.
    converted = json.dumps({"type": "error", "error": {"type": "internal_error", "message": message}})
    return stream.pass_on(f"event: error\ndata: {converted}\n\n"), stream.trailer()


def test_a_messages_stream_whose_engine_fails_leaves_the_ending_to_the_router(caplog):
    """As a chat stream's: vLLM's words go to the log only; the trailer says the engine failed,
    and the router resumes the stream elsewhere or ends it with its own error event, in
    Anthropic's shape (``test_terminal_event.py``)."""
    event, trailer = _messages_stream_error(500, f"EngineCore failed: {INTERNAL}", caplog)
    assert event is None
    assert (trailer.complete, trailer.error_code, trailer.error_status) == (False, "engine_unavailable", None)
    assert "10.0.0.5" in caplog.text


def test_a_messages_stream_refusing_the_clients_input_keeps_vllms_message(caplog):
    event, trailer = _messages_stream_error(400, "'temperature' must be at most 1", caplog)
    assert "'temperature' must be at most 1" in event
    assert trailer.error_status == 400


# --- a stream the engine refuses as it takes the request --------------------------------------


def stream_answer(events, output=surfaces.CHAT):
    """What the replica answers for a stream whose vLLM generator is ``events`` (made from a
    list of a close log); its items if it streams."""
    closed = []

    async def source():
        try:
            for event in events:
                if isinstance(event, BaseException):
                    raise event
                yield event
            await asyncio.sleep(3600)  # the engine's output, never coming: the head goes first
        finally:
            closed.append(True)

    async def create(request, raw_request):
        return source()

    async def scenario():
        engine = VLLMEngine(ModelDeploymentArgs(id="qwen-3.6-35b-a3b"), "/weights")
        result = await engine._run(ChatCompletionRequest, create, {**BODY, "stream": True}, output)
        if not hasattr(result, "events"):
            return result, closed
        first = await result.events.__anext__()
        await result.events.aclose()
        return first, closed

    return asyncio.run(scenario())


def chat_error(status: int, message: str, param: str | None = None) -> str:
    import json

    error = {"message": message, "type": "BadRequestError", "param": param, "code": status}
    return f"data: {json.dumps({'error': error})}\n\n"


def test_a_stream_refused_as_the_engine_takes_it_is_a_4xx_before_any_head():
    """vLLM's chat stream yields its refusal (a grammar xgrammar cannot compile) as its first
    event, before it waits for the engine: the client gets a 400 with vLLM's words, as a
    non-stream request does, and the generator is closed."""
    result, closed = stream_answer([chat_error(400, "Grammar error: Invalid type: strin", "response_format"),
                                    "data: [DONE]\n\n"])
    assert result.status == 400
    assert result.body["error"] == {"message": "Grammar error: Invalid type: strin", "type": "invalid_request_error",
                                    "param": "response_format", "code": None}
    assert closed == [True]


def test_a_stream_raising_its_refusal_after_opening_events_is_a_4xx_before_any_head():
    """A Responses stream yields two events, then raises what vLLM found as it submitted."""
    refusal = VLLMValidationError("Grammar error: Invalid type: strin")
    result, closed = stream_answer(["created", "in_progress", refusal], output=surfaces.ResponsesOutput())
    assert (result.status, result.body["error"]["message"]) == (400, "Grammar error: Invalid type: strin")
    assert closed == [True]


def test_a_server_fault_before_the_head_is_answered_in_our_words(caplog):
    caplog.set_level(logging.ERROR)
    result, _ = stream_answer(["created", RuntimeError(INTERNAL)], output=surfaces.ResponsesOutput())
    assert (result.status, result.body["error"]["code"]) == (500, "internal")
    assert "10.0.0.5" not in str(result.body) and "10.0.0.5" in caplog.text


@pytest.mark.parametrize("first", ['data: {"id":"c1","choices":[]}\n\n', chat_error(500, f"EngineCore: {INTERNAL}")])
def test_a_stream_under_way_or_failing_in_the_engine_streams(first):
    """An engine failure (5xx) is the stream's to report (the router resumes it elsewhere);
    anything else streams, its first event first."""
    result, closed = stream_answer([first])
    assert result == first and closed == [True]


def test_a_messages_stream_refused_under_the_converter_is_a_4xx(caplog):
    """The converter words vLLM's refusal as an internal_error event; the replica answers the
    chat stream's own error, which ``peek_chat_metrics`` kept."""
    stream = surfaces.MessagesStream({"model": "qwen-3.6-35b-a3b"})

    async def peeked():
        async def chat():
            yield chat_error(400, "Grammar error: Invalid type: strin")

        async for _ in surfaces.peek_chat_metrics(chat(), stream):
            pass

    asyncio.run(peeked())
    assert stream.refusal('event: error\ndata: {"type":"error","error":{"type":"internal_error"}}\n\n')["code"] == 400
    assert stream.refusal("event: message_start\ndata: {}\n\n") is None


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "strin"}}}
GOOD_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}


@pytest.mark.parametrize(
    "tools, param",
    [
        ([{"type": "function", "function": {"name": "f", "parameters": GOOD_SCHEMA}},
          {"type": "function", "function": {"name": "g", "parameters": BAD_SCHEMA}}], "tools[1].function.parameters"),
        ([{"name": "f", "input_schema": BAD_SCHEMA}], "tools[0].input_schema"),  # Messages
        ([{"type": "function", "name": "f", "parameters": BAD_SCHEMA}], "tools[0].parameters"),  # Responses
    ],
)
def test_a_tool_schema_no_grammar_can_be_made_of_is_named_with_xgrammars_reason(tools, param):
    """vLLM words it "Invalid grammar specification: 'triggers'" (its guidance fallback failing
    on the structural tag Qwen's tool parser builds), which says nothing a client can act on."""
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    from serve_app.engine import vllm_errors

    unreadable = ErrorResponse(error=ErrorInfo(message="Invalid grammar specification: 'triggers'",
                                               type="BadRequestError", code=400))
    error = vllm_errors.error_answer(unreadable, body={"tools": tools}).body["error"]
    assert error["param"] == param
    assert error["message"] == f'{param} cannot be compiled into a grammar: Unsupported type "strin"'
    # Schemas xgrammar compiles: vLLM's words stay, nothing is made up.
    kept = vllm_errors.error_answer(unreadable, body={"tools": [{"name": "f", "input_schema": GOOD_SCHEMA}]})
    assert kept.body["error"]["message"] == "Invalid grammar specification: 'triggers'"


def test_a_tool_schema_nested_past_vllms_limit_is_named_without_being_compiled():
    """vLLM refuses a structural tag nested too deeply before xgrammar sees it (compiling costs
    steeply more per level), then words it "'triggers'" too: the schema is not compiled here
    either, and the answer says why."""
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    from serve_app.engine import vllm_errors

    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    unreadable = ErrorResponse(error=ErrorInfo(message="Invalid grammar specification: 'triggers'",
                                               type="BadRequestError", code=400))
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": deep}}}]
    error = vllm_errors.error_answer(unreadable, body={"tools": tools}).body["error"]
    assert error["param"] == "tools[0].parameters" and "nested too deeply" in error["message"]


BAD_GRAMMAR = {"type": "no-such-type"}


@pytest.mark.parametrize("message, body, param", [
    # The CPU engine's words (guidance, after vLLM's fallback from xgrammar), as the live service answers.
    ("Grammar error: Invalid type: no-such-type",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_GRAMMAR}}},
     "response_format.json_schema.schema"),
    ("Grammar error: at 1(8): invalid regex \"(a\"", {"structured_outputs": {"regex": "(a"}},
     "structured_outputs.regex"),
    ("Invalid grammar specification: Failed to convert the grammar from GBNF to Lark",
     {"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ("Choice '[]' cannot be an empty list", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("Grammar error: Invalid type: no-such-type",
     {"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_GRAMMAR}}},
     "text.format.schema"),  # Responses
    ("Failed to transform json schema into a grammar: x",  # xgrammar's words (a GPU engine's first backend)
     {"response_format": {"type": "json_schema", "json_schema": {"schema": BAD_GRAMMAR}}},
     "response_format.json_schema.schema"),
    ("structured_outputs.regex must not contain a NUL character ('\\x00')",  # vLLM names it in its words
     {"structured_outputs": {"regex": "a\x00", "json_object": False, "choice": None}}, "structured_outputs.regex"),
    ("Grammar error: x", {"structured_outputs": {"regex": "(a"}, "tools": [{"type": "function"}],
                          "tool_choice": "none"}, "structured_outputs.regex"),  # tools the model may not call
    # Nothing guessed: two grammars, a forced tool call's grammar, none, another refusal.
    ("Grammar error: x", {"structured_outputs": {"regex": "(a"},
                          "response_format": {"type": "json_schema", "json_schema": {"schema": BAD_GRAMMAR}}}, None),
    ("Grammar error: x", {"structured_outputs": {"regex": "(a"}, "tools": [{"type": "function"}],
                          "tool_choice": "required"}, None),
    ("Grammar error: x", {"response_format": {"type": "json_object"}}, None),
    ("Grammar error: x", {"structured_outputs": {"json_object": False},  # vLLM takes structured_outputs then
                          "response_format": {"type": "json_schema", "json_schema": {"schema": BAD_GRAMMAR}}}, None),
    ("Grammar error: x", {"structured_outputs": {"regex": "(a", "grammar": "root ::= x"}}, None),
    ("Grammar error: x", {"response_format": {"type": "json_schema", "json_schema": {"schema": BAD_GRAMMAR}},
                          "tools": [{"type": "function"}]}, None),  # tool_choice auto: vLLM merges the two
    ("Invalid structural tag specification.", {"response_format": {"type": "json_schema"},
                                               "tools": [{"type": "function"}]}, None),  # no tool schema to blame
    ("Grammar error: x", {"output_config": {"format": {"type": "json_schema", "schema": BAD_GRAMMAR}}},
     None),  # Messages: Anthropic's errors have no param
    ("temperature must be non-negative", {"structured_outputs": {"regex": "(a"}}, None),
])
def test_a_grammar_the_engine_cannot_compile_names_the_field_it_came_from(message, body, param):
    """vLLM names no parameter for a grammar no backend compiles; the client's field is named when
    the request carries exactly one grammar."""
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    from serve_app.engine import vllm_errors

    refused = ErrorResponse(error=ErrorInfo(message=message, type="BadRequestError", code=400))
    error = vllm_errors.error_answer(refused, body={"model": "m", **body}).body["error"]
    assert error["param"] == param and error["message"] == message
