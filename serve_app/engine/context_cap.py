"""Reject requests whose prompt plus requested completion exceeds the served context cap.

vLLM silently lowers ``max_tokens`` to whatever fits after the prompt. This product answers
400 ``context_length_exceeded`` instead (OpenAI's behaviour), so a client learns that its request
cannot be served as asked rather than receiving a completion cut short. The check runs on the
prompt vLLM has already rendered and tokenized, so nothing is tokenized twice.

A limit the *router* set (the request set none, and was priced with the router's default) is not
the client's to be refused for: it is lowered to what the real prompt leaves, which is never more
than the router charged (``clamp_this_request``).
"""

import contextvars
from typing import Any

# Whether the request this task serves has a router-set limit (``wire.Call.limit_set_by_router``).
_CLAMP: contextvars.ContextVar[bool] = contextvars.ContextVar("serve_app_clamp_limit", default=False)


def clamp_this_request(clamp: bool) -> None:
    """For the request this task serves: lower a limit over the context instead of refusing it."""
    _CLAMP.set(clamp)

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# The parameters vLLM names when the prompt alone is over the cap.
VLLM_PROMPT_TOO_LONG_PARAMS = {"input_tokens", "input_text"}


def overflow_message(max_model_len: int, prompt_tokens: int, completion_tokens: int) -> str:
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the prompt, "
        f"{completion_tokens} in the completion). Please reduce the length of the prompt or "
        "max_tokens."
    )


def install(serving: Any, render_method: str, prompt_param: str) -> None:
    """Wrap ``serving.<render_method>`` (vLLM's render step) with the cap check."""
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    render = getattr(serving, render_method)
    max_model_len = serving.model_config.max_model_len

    async def render_within_cap(request):
        result = await render(request)
        if isinstance(result, ErrorResponse):
            return result
        engine_inputs = result[-1] if isinstance(result, tuple) else result
        requested = getattr(request, "max_completion_tokens", None) or request.max_tokens
        if requested is None:
            return result
        for engine_input in engine_inputs:
            prompt_tokens = serving._extract_prompt_len(engine_input)
            if prompt_tokens + requested > max_model_len and _CLAMP.get() and prompt_tokens < max_model_len:
                _lower_limit(request, max_model_len - prompt_tokens)
                requested = max_model_len - prompt_tokens
            elif prompt_tokens + requested > max_model_len:
                message = overflow_message(max_model_len, prompt_tokens, requested)
                # vLLM's ErrorInfo.code is the HTTP status; the reason travels in `type` and
                # is_context_overflow() recognises it when the replica builds the error body.
                error = ErrorInfo(message=message, type=CONTEXT_LENGTH_EXCEEDED, param=prompt_param, code=400)
                return ErrorResponse(error=error)
        return result

    # An instance attribute shadows the method for this serving object only; vLLM's request
    # path calls self.<render_method>(request) and returns an ErrorResponse as it is.
    setattr(serving, render_method, render_within_cap)


def _lower_limit(request: Any, limit: int) -> None:
    """Set the completion limit fields the request uses to ``limit``."""
    for field in ("max_completion_tokens", "max_tokens"):
        if getattr(request, field, None) is not None:
            setattr(request, field, limit)


def is_context_overflow(error: Any) -> bool:
    """True for our cap check's error and for vLLM's own prompt-too-long errors."""
    return error.type == CONTEXT_LENGTH_EXCEEDED or error.param in VLLM_PROMPT_TOO_LONG_PARAMS
