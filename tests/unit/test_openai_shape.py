"""Schema-exact non-stream bodies, built from vLLM's own response models as the replica gets them.

The bodies are vLLM 0.32's ``model_dump()`` (no engine needed to build the pydantic objects), so a
vLLM upgrade that adds a nullable field shows up here. The stream test records what vLLM's
chunks still carry (docs/api.md, "Schema-exact bodies").
"""

import json

import pytest
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
)
from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

from serve_app.engine import openai_shape, trailer

CHAT_REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def usage(**fields):
    return UsageInfo(prompt_tokens=9, completion_tokens=3, total_tokens=12, **fields)


def chat_body(message=None, **choice_fields):
    choice = ChatCompletionResponseChoice(
        index=0,
        message=message or ChatMessage(role="assistant", content="Hello there"),
        logprobs=choice_fields.pop("logprobs", None),
        finish_reason=choice_fields.pop("finish_reason", "stop"),
        **choice_fields,
    )
    return ChatCompletionResponse(model="m", choices=[choice], usage=usage()).model_dump()


def shaped_chat(body, request=CHAT_REQUEST):
    trailer.from_response(body)  # the replica takes `metrics` off first
    return openai_shape.chat(body, request)


def test_vllm_dumps_the_nulls_the_conformance_suite_rejects():
    body = chat_body()
    message = body["choices"][0]["message"]
    assert message["annotations"] is None and message["function_call"] is None
    assert body["service_tier"] is None and body["usage"]["prompt_tokens_details"] is None
    assert body["choices"][0]["token_ids"] is None and "stop_reason" in body["choices"][0]


def test_plain_chat_body_has_no_null_where_the_spec_says_object_array_or_enum():
    body = shaped_chat(chat_body())
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    choice = body["choices"][0]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
    assert choice["logprobs"] is None  # required and nullable: stays, as null
    # content and refusal are required (nullable); the rest is absent rather than null.
    assert choice["message"] == {"role": "assistant", "content": "Hello there", "refusal": None}
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    json.dumps(body)  # still plain JSON


def test_tool_call_message_keeps_content_null_and_its_tool_calls():
    from vllm.entrypoints.generate.base.protocol import FunctionCall, ToolCall

    call = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Tokyo"}'))
    body = shaped_chat(chat_body(ChatMessage(role="assistant", content=None, tool_calls=[call]), finish_reason="tool_calls"))
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["refusal"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "function_call" not in message and "annotations" not in message


def test_reasoning_is_kept_when_there_is_some():
    body = shaped_chat(chat_body(ChatMessage(role="assistant", content="4", reasoning="2 + 2")))
    assert body["choices"][0]["message"]["reasoning"] == "2 + 2"


def test_chat_logprobs_get_the_refusal_the_spec_requires_and_keep_their_entries():
    entry = ChatCompletionLogProbsContent(
        token="Hi", logprob=-0.1, bytes=None, top_logprobs=[ChatCompletionLogProb(token="Hi", logprob=-0.1)]
    )
    body = shaped_chat(chat_body(logprobs=ChatCompletionLogProbs(content=[entry])))
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["refusal"] is None
    assert logprobs["content"][0]["token"] == "Hi" and "bytes" in logprobs["content"][0]  # required, nullable


def test_token_ids_are_returned_only_when_asked_for():
    raw = ChatCompletionResponse(
        model="m",
        choices=[
            ChatCompletionResponseChoice(
                index=0, message=ChatMessage(role="assistant", content="x"), token_ids=[7, 8], stop_reason=None
            )
        ],
        usage=usage(),
        prompt_token_ids=[1, 2, 3],
    ).model_dump()
    unasked = shaped_chat(json.loads(json.dumps(raw)))
    assert "prompt_token_ids" not in unasked and "token_ids" not in unasked["choices"][0]
    asked = shaped_chat(raw, {**CHAT_REQUEST, "return_token_ids": True})
    assert asked["prompt_token_ids"] == [1, 2, 3] and asked["choices"][0]["token_ids"] == [7, 8]


@pytest.mark.parametrize(
    "request_fields, kept",
    [({}, False), ({"stop": ["\n\n"]}, True), ({"stop_token_ids": [13]}, True)],
)
def test_stop_reason_is_returned_only_to_a_caller_that_set_stop(request_fields, kept):
    body = shaped_chat(chat_body(stop_reason="\n\n"), {**CHAT_REQUEST, **request_fields})
    assert ("stop_reason" in body["choices"][0]) is kept


def test_set_fields_pass_unchanged_and_cached_tokens_stay():
    raw = ChatCompletionResponse(
        model="m",
        choices=[ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content="x"))],
        usage=usage(prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=8)),
        system_fingerprint="fp_1",
        service_tier="default",
    ).model_dump()
    body = shaped_chat(raw)
    assert body["system_fingerprint"] == "fp_1" and body["service_tier"] == "default"
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}


def test_completion_body_keeps_text_and_logprobs_and_drops_vllm_extras():
    raw = CompletionResponse(
        model="m",
        choices=[
            CompletionResponseChoice(index=0, text="Once upon", finish_reason="length"),
            CompletionResponseChoice(
                index=1,
                text=" a time",
                finish_reason="length",
                logprobs=CompletionLogProbs(text_offset=[0], token_logprobs=[-0.5], tokens=[" a"], top_logprobs=[None]),
                prompt_token_ids=[1, 2],
            ),
        ],
        usage=usage(),
    ).model_dump()
    trailer.from_response(raw)
    body = openai_shape.completion(raw, {"model": "m", "prompt": "x"})
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    first, second = body["choices"]
    assert first == {"index": 0, "text": "Once upon", "logprobs": None, "finish_reason": "length"}
    assert second["logprobs"]["tokens"] == [" a"] and "prompt_token_ids" not in second


def test_completion_prompt_logprobs_and_token_ids_when_asked_for():
    raw = CompletionResponse(
        model="m",
        choices=[
            CompletionResponseChoice(
                index=0, text="x", finish_reason="stop", prompt_token_ids=[1], token_ids=[5], prompt_logprobs=[None]
            )
        ],
        usage=usage(),
    ).model_dump()
    request = {"model": "m", "prompt": "x", "return_token_ids": True, "prompt_logprobs": 0}
    choice = openai_shape.completion(raw, request)["choices"][0]
    assert choice["prompt_token_ids"] == [1] and choice["token_ids"] == [5] and choice["prompt_logprobs"] == [None]


def test_the_trailer_still_sees_usage_and_finish_reasons():
    body = chat_body()
    summary = trailer.from_response(body)
    openai_shape.chat(body, CHAT_REQUEST)
    assert summary.usage["prompt_tokens"] == 9 and summary.finish_reasons == ("stop",)


def test_tokenize_body_drops_token_strs_when_not_asked():
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeResponse

    body = TokenizeResponse(count=2, max_model_len=8192, tokens=[9707, 1879]).model_dump()
    assert openai_shape.without_nulls(body, {"prompt": "hi"}) == {"count": 2, "max_model_len": 8192, "tokens": [9707, 1879]}


def test_what_vllm_stream_chunks_still_carry():
    """Recorded, not fixed: vLLM dumps chunks with exclude_unset, and sets these fields explicitly
    (to null) on every token chunk. Spec-valid (nullable or an extra field), but vLLM-only; if a
    vLLM upgrade stops sending them, docs/api.md ("Schema-exact bodies") should say so."""
    chunk = ChatCompletionStreamResponse(
        id="chatcmpl-1",
        object="chat.completion.chunk",
        created=1,
        model="m",
        choices=[
            ChatCompletionResponseStreamChoice(
                index=0, delta=DeltaMessage(content="Hi"), logprobs=None, finish_reason=None, token_ids=None
            )
        ],
    )
    choice = json.loads(chunk.model_dump_json(exclude_unset=True))["choices"][0]
    assert choice == {"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None, "token_ids": None}
