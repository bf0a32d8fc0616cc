"""vLLM's errors as our answers: a 4xx keeps vLLM's message (it says what to fix) and its
``param``; a server fault is told in our words, with vLLM's logged (``vllm_engine.py`` uses these)."""

import re

from serve_app.engine import rendered
from serve_app.errors import error_body
from serve_app.telemetry.logs import module_logger
from serve_app.wire.messages import Answer

logger = module_logger(__name__)

# What a client reads for a server fault. vLLM's own words (an exception's text, a media fetch
# error naming an internal host and port) go to this replica's log, which Serve stamps with the
# request id the client got in ``x-request-id``; a 4xx keeps vLLM's message: it says what to fix.
_SERVER_FAULT = ("the model failed to serve this request; it has been logged", "internal")
_SERVER_FAULTS = {
    501: ("the model engine does not support part of this request", "not_implemented"),
    503: ("the model engine cannot take this request now; retry", None),  # the router may fail over
}


def error_answer(response, exc: BaseException | None = None, *, prompt_field: str | None = None) -> Answer:
    """vLLM's ``ErrorResponse`` as our answer; ``exc``: the exception it was made from, if any;
    ``prompt_field``: the request's prompt field (``messages``, ``prompt``, ``input``), which a
    prompt over the context is reported as, where vLLM names its own internal one."""
    error = response.error
    if error.code >= 500:
        logger.error("vLLM answered %s: %s", error.code, error.message, exc_info=exc)
        message, code = _SERVER_FAULTS.get(error.code, _SERVER_FAULT)
        return Answer(error.code, error_body(error.code, message, code=code))
    if not rendered.is_context_overflow(error):
        return Answer(error.code, error_body(error.code, error.message, param=error.param))
    param, message = error.param, error.message
    if prompt_field is not None and param in rendered.VLLM_PROMPT_TOO_LONG_PARAMS:
        param, message = prompt_field, _INTERNAL_PARAM.sub("", message)
    return Answer(error.code, error_body(error.code, message, param=param, code=rendered.CONTEXT_LENGTH_EXCEEDED))


# vLLM's validation errors end their message with the parameter they name: internal ones mean
# nothing to a client.
_INTERNAL_PARAM = re.compile(r"\s*\(parameter=\w+, value=[^)]*\)\s*$")


def prompt_field(body: dict) -> str | None:
    """The field a request's prompt is in, as the client sent it."""
    return next((field for field in ("messages", "prompt", "input") if field in body), None)


def validation_answer(err) -> Answer:
    from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param

    errors = err.errors()
    first = errors[0]
    param = clean_loc_for_param(tuple(first["loc"])) if first.get("loc") else None
    details = "; ".join(
        f"{clean_loc_for_param(tuple(e['loc'])) or 'body'}: {e['msg']}" for e in errors[:5]
    )
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return Answer(400, error_body(400, f"invalid request: {details}{more}", param=param))
