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
