"""What the replica does to the prompt vLLM has rendered and tokenized, before the engine runs it.

- **The context cap.** vLLM silently lowers ``max_tokens`` to whatever fits after the prompt.
  This product answers 400 ``context_length_exceeded`` instead (OpenAI's behaviour), so a client
  learns that its request cannot be served as asked rather than receiving a completion cut short.
  The check runs on the rendered prompt, so nothing is tokenized twice.
- **The router's limit.** A limit the *router* set (the request set none, and was priced with the
  router's default) is not the client's to be refused for: it is lowered to what the real prompt
  leaves, which is never more than the router charged.
- **A resumed stream.** A stream whose engine failed elsewhere continues here from exactly where
  it stopped: the same request renders to the same prompt, and the tokens it had generated are
  appended to it (``wire.Resume``), so the engine's next token is the one the first engine would
  have generated next — no re-tokenized text at the seam (Responses too, ``install_tail``).

Which of these apply is the request's own (``for_this_request``), kept in a context variable of
the task that serves it.
"""

import contextvars
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class _Rules:
    clamp_limit: bool = False  # the limit is the router's: lower it, never refuse
    continue_with: tuple[int, ...] = ()  # a resumed stream's generated tokens: the prompt's tail


_RULES: contextvars.ContextVar[_Rules] = contextvars.ContextVar("serve_app_render_rules", default=_Rules())


def for_this_request(*, clamp_limit: bool = False, continue_with: tuple[int, ...] = ()) -> None:
    """The rules of the request this task serves (``wire.Call``'s ``limit_set_by_router`` and
    ``resume``)."""
    _RULES.set(_Rules(clamp_limit, tuple(continue_with)))


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# A pooling request's inputs over the request cap (``install_request_cap``): like a prompt over the
# context, refused after the replica tokenized it all, so its estimate stays charged.
MAX_TOKENS_PER_REQUEST = "max_tokens_per_request"
# The replica's refusals of what the router could only estimate, after the work of rendering it.
REFUSED_AFTER_RENDERING = frozenset({CONTEXT_LENGTH_EXCEEDED, MAX_TOKENS_PER_REQUEST})
# (vLLM's ``VLLMValidationError`` adds its parameter to the words.)
_OVER_REQUEST_CAP = re.compile(
    r"(the input is \d+ tokens, all its entries together; at most \d+ in one request)(?: \(parameter=input\))?")
# The parameters vLLM names when the prompt alone is over the cap.
VLLM_PROMPT_TOO_LONG_PARAMS = {"input_tokens", "input_text"}


def overflow_message(max_model_len: int, prompt_tokens: int, completion_tokens: int) -> str:
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the prompt, "
        f"{completion_tokens} in the completion). Please reduce the length of the prompt or "
        "max_tokens."
    )


def install_tail(serving: Any, render_method: str) -> None:
    """Wrap ``serving.<render_method>``, whose result holds one ``engine_input``, to append a
    resumed stream's tail (Responses: its render answers an object, and its cap is vLLM's own)."""
    render = getattr(serving, render_method)

    async def render_with_tail(*args, **kwargs):
        result = await render(*args, **kwargs)
        tail = _RULES.get().continue_with
        if tail and hasattr(result, "engine_input"):
            result.engine_input["prompt_token_ids"] = [*result.engine_input["prompt_token_ids"], *tail]
        return result

    setattr(serving, render_method, render_with_tail)


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
        rules = _RULES.get()
        if rules.continue_with:
            for engine_input in engine_inputs:
                engine_input["prompt_token_ids"] = [*engine_input["prompt_token_ids"], *rules.continue_with]
        requested = getattr(request, "max_completion_tokens", None) or request.max_tokens
        if requested is None:
            return result
        for engine_input in engine_inputs:
            prompt_tokens = serving._extract_prompt_len(engine_input)
            if prompt_tokens + requested > max_model_len and rules.clamp_limit and prompt_tokens < max_model_len:
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


def install_request_cap(serving: Any, max_tokens: int) -> None:
    """Cap a pooling request's tokens, all its inputs together (OpenAI's 300,000 for embeddings):
    checked on the rendered inputs, as vLLM's pooling serving object turns them into engine
    requests (``_prepare_generators``: all at once, each an engine request).

    The router caps token-id inputs, which it can count; text it can only estimate from its size,
    which digits undercut fourfold (one token a byte): one 2 MiB body of 2,048 strings of digits
    was ~2M tokens — 128 full engine steps at 16,384 batched tokens, which the tier's other
    requests queued behind (vLLM's scheduler orders by priority, then arrival)."""
    from vllm.exceptions import VLLMValidationError

    prepare = serving._prepare_generators

    async def prepare_within_cap(ctx):
        inputs = ctx.engine_inputs or ()
        total = sum(len(engine_input["prompts"].get("prompt_token_ids") or ()) for engine_input in inputs)
        if total > max_tokens:  # its words are how over_request_cap knows it (vLLM keeps no code)
            raise VLLMValidationError(
                f"the input is {total} tokens, all its entries together; at most {max_tokens} in one request",
                parameter="input")
        await prepare(ctx)

    setattr(serving, "_prepare_generators", prepare_within_cap)  # this serving object's only, as ``install``


def _lower_limit(request: Any, limit: int) -> None:
    """Set the completion limit fields the request uses to ``limit``."""
    for field in ("max_completion_tokens", "max_tokens"):
        if getattr(request, field, None) is not None:
            setattr(request, field, limit)


def over_request_cap(error: Any) -> str | None:
    """The client's words of ``install_request_cap``'s refusal, if vLLM's ``ErrorResponse`` is it."""
    found = _OVER_REQUEST_CAP.fullmatch(error.message) if error.param == "input" else None
    return found.group(1) if found else None


def is_context_overflow(error: Any) -> bool:
    """True for our cap check's error and for vLLM's own prompt-too-long errors."""
    return error.type == CONTEXT_LENGTH_EXCEEDED or error.param in VLLM_PROMPT_TOO_LONG_PARAMS
