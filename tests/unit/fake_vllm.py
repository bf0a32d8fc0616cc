"""The Responses and Messages answers of the fake engine, made by vLLM's own code (0.32) from the
fake's counted generation, as ``VLLMEngine`` makes them from the engine's.

Whole answers: vLLM's ``ResponsesResponse.from_request`` (the final response of
``responses_full_generator``) and ``messages_full_converter`` over a chat response, each with the
engine's ``metrics``, through the real ``outputs.ResponsesOutput`` / ``MessagesOutput`` (dump,
trailer, shape), as ``VLLMEngine._run`` does. Streams:

- Responses: vLLM's ``responses_stream_generator`` (non-Harmony path): ``response.created`` and
  ``response.in_progress`` around ``ResponsesResponse.from_request(..., usage=None)``, the text
  item through ``streaming_events.emit_simple_content_*``, then ``response.completed`` with the
  final response (usage, the engine's ``metrics``; status ``incomplete`` when the output limit cut
  it), each event numbered in order (``sequence_number``) — vLLM's event objects, which the real
  ``outputs.ResponsesStream`` dumps, shapes and frames;
- Messages: vLLM's ``message_stream_converter`` over the fake's chat SSE stream (read on the way by
  the real ``outputs.peek_chat_metrics``), whose frames the real ``outputs.MessagesStream`` passes.

vLLM (and torch) are imported on the first such answer only: tests that never use these surfaces
never pay for it.
"""

import copy
from typing import Any

from serve_app.engine import outputs
from serve_app.wire.messages import Answer

Body = dict[str, Any]


def import_vllm() -> None:
    """Import what the answers below use (once; a no-op after): a caller on an event loop runs
    this on a thread first, so the loop is not held for the seconds it takes."""
    import vllm.entrypoints.anthropic.serving  # noqa: F401
    import vllm.entrypoints.openai.chat_completion.protocol  # noqa: F401
    import vllm.entrypoints.openai.responses.protocol  # noqa: F401
    import vllm.entrypoints.openai.responses.streaming_events  # noqa: F401


def validated_responses_request(body: Body):
    """vLLM's ``ResponsesRequest`` of ``body`` (a copy: vLLM edits the dict it validates), or the
    400 ``Answer`` the real engine gives for a body vLLM refuses."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    from serve_app.engine.vllm_errors import validation_answer

    try:
        return ResponsesRequest.model_validate(copy.deepcopy(body))
    except ValidationError as err:
        return validation_answer(err)


def _usage(prompt_tokens: int, completion_tokens: int, cached: int):
    from vllm.entrypoints.openai.responses.protocol import InputTokensDetails, OutputTokensDetails, ResponseUsage

    return ResponseUsage(
        input_tokens=prompt_tokens, output_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached, cache_write_tokens=0),
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
    )


def _final_response(request, params, output: list, *, status: str, usage, metrics: Body):
    from vllm.entrypoints.generate.base.protocol import PerRequestMetrics
    from vllm.entrypoints.openai.responses.protocol import ResponsesResponse

    return ResponsesResponse.from_request(
        request, params, model_name=request.model, created_time=1, output=output, status=status, usage=usage,
        metrics=PerRequestMetrics(**metrics),
    )


def responses_answer(request, shape_body: Body, text: str, *, wanted: int, total: int, prompt_tokens: int,
                     cached: int, metrics: Body) -> Answer:
    """A whole Responses answer with ``text`` as its one message, as ``VLLMEngine._run`` makes it."""
    from openai.types.responses import ResponseOutputMessage, ResponseOutputText

    part = ResponseOutputText(type="output_text", text=text, annotations=[], logprobs=None)
    item = ResponseOutputMessage(id="msg_1", type="message", role="assistant", status="completed", content=[part])
    status = "incomplete" if wanted < total else "completed"
    final = _final_response(request, request.to_sampling_params(wanted, {}), [item], status=status,
                            usage=_usage(prompt_tokens, wanted, cached), metrics=metrics)
    return _answer(outputs.ResponsesOutput(), final, shape_body)


def messages_answer(body: Body, text: str, *, prompt_tokens: int, completion_tokens: int, finish_reason: str,
                    metrics: Body) -> Answer:
    """A whole Messages answer: vLLM's converter over the chat response of ``text``."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    chat = ChatCompletionResponse(
        id="chatcmpl-f", model=body.get("model"),
        choices=[ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content=text),
                                              finish_reason=finish_reason)],
        usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                        total_tokens=prompt_tokens + completion_tokens),
    )
    message = AnthropicServingMessages.messages_full_converter(None, chat)
    return _answer(outputs.MessagesOutput(), outputs.ConvertedMessage(message, dict(metrics)), body)


def _answer(output, result, shape_body: Body) -> Answer:
    response = output.dump(result)
    summary = output.summarize(response)
    output.shape(response, shape_body)
    return Answer(200, response, summary)


async def responses_events(request, outputs, *, wanted: int, total: int, prompt_tokens: int, cached: int,
                           metrics: Body):
    """vLLM's Responses stream events for the fake generation ``outputs`` (``wanted`` tokens of
    the ``total`` the fake would give without a limit)."""
    from vllm.entrypoints.openai.responses import streaming_events as emit
    from vllm.entrypoints.openai.responses.protocol import (
        ResponseCompletedEvent,
        ResponseCreatedEvent,
        ResponseInProgressEvent,
        ResponsesResponse,
    )

    params = request.to_sampling_params(wanted, {})
    number = 0

    def numbered(event):
        nonlocal number
        event.sequence_number, number = number, number + 1
        return event

    initial = ResponsesResponse.from_request(
        request, params, model_name=request.model, created_time=1, output=[], status="in_progress", usage=None
    ).model_dump(mode="json", by_alias=True)
    yield numbered(ResponseCreatedEvent(type="response.created", sequence_number=-1, response=initial))
    yield numbered(ResponseInProgressEvent(type="response.in_progress", sequence_number=-1, response=initial))
    state = emit.SimpleStreamingState()
    produced = 0
    try:
        async for output in outputs:
            if produced == 0:
                for event in emit.emit_simple_content_open(state):
                    yield numbered(event)
            produced += 1
            for event in emit.emit_simple_content_delta(state, output.outputs[0].text):
                yield numbered(event)
    finally:
        await outputs.aclose()  # closing the stream aborts the generation
    done = emit.emit_simple_content_done(state) if produced else []
    for event in done:
        yield numbered(event)
    final = _final_response(request, params, [done[-1].item] if done else [],
                            status="incomplete" if wanted < total else "completed",
                            usage=_usage(prompt_tokens, produced, cached), metrics=metrics)
    yield numbered(ResponseCompletedEvent(type="response.completed", sequence_number=-1, response=final))


def messages_events(chat_events, watcher):
    """vLLM's Anthropic frames of the fake's chat SSE stream (``chat_events``), whose engine timing
    ``watcher`` (an ``outputs.MessagesStream``) notes on the way, as in ``VLLMEngine``."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    # The converter uses nothing of its instance (tests/unit/test_anthropic_shape.py does the same).
    return AnthropicServingMessages.message_stream_converter(None, outputs.peek_chat_metrics(chat_events, watcher))
