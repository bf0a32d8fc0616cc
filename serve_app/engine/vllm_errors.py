"""vLLM's errors as our answers: a 4xx keeps vLLM's message (it says what to fix) and its
``param``; a server fault is told in our words, with vLLM's logged (``vllm_engine.py`` uses these)."""

import re
from typing import Any

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


def error_answer(response, exc: BaseException | None = None, *, body: dict | None = None) -> Answer:
    """vLLM's ``ErrorResponse`` as our answer; ``exc``: the exception it was made from, if any;
    ``body``: the request as the client sent it, whose fields a 4xx names where vLLM names its
    own: the prompt's (``messages``, ``prompt``, ``input``) for a prompt over the context, and
    the tool whose schema no grammar can be made of (``_uncompilable_tool_schema``)."""
    error = response.error
    if error.code >= 500:
        logger.error("vLLM answered %s: %s", error.code, error.message, exc_info=exc)
        message, code = _SERVER_FAULTS.get(error.code, _SERVER_FAULT)
        return Answer(error.code, error_body(error.code, message, code=code))
    body, param, message = body or {}, error.param, error.message
    if not rendered.is_context_overflow(error):
        if message.startswith(_UNREADABLE_TOOL_GRAMMAR) and (found := _uncompilable_tool_schema(body.get("tools"))):
            param, message = found
        elif param is None and message.startswith(_GRAMMAR_REFUSALS):
            param = grammar_field(body)
        return Answer(error.code, error_body(error.code, message, param=param))
    field = prompt_field(body)
    if field is not None and param in rendered.VLLM_PROMPT_TOO_LONG_PARAMS:
        param, message = field, _INTERNAL_PARAM.sub("", message)
    return Answer(error.code, error_body(error.code, message, param=param, code=rendered.CONTEXT_LENGTH_EXCEEDED))


def error_response(error: dict):
    """vLLM's ``ErrorResponse`` for the error object of one of its stream's error events."""
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    info = ErrorInfo(message=str(error.get("message") or "invalid request"), param=error.get("param"),
                     type=str(error.get("type") or "BadRequestError"), code=int(error.get("code") or 400))
    return ErrorResponse(error=info)


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


# vLLM's words for a tool schema xgrammar cannot compile: Qwen's tool parser constrains the output
# with a structural tag holding every tool's schema, xgrammar refuses it, and the guidance
# fallback, which reads only the older structural-tag format, fails on its missing `triggers` key.
_UNREADABLE_TOOL_GRAMMAR = ("Invalid grammar specification: 'triggers'", "Invalid structural tag specification")
# xgrammar's message starts with a time and its C++ source line: "[08:55:43] /project/cpp/x.cc:49: ".
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _uncompilable_tool_schema(tools: Any) -> tuple[str, str] | None:
    """The first tool schema xgrammar cannot compile, as a ``param`` and a message with
    xgrammar's reason; compiled again one by one only after vLLM refused them all unreadably."""
    import json

    import xgrammar
    from vllm.sampling_params import check_json_nesting

    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not isinstance(tool, dict):
            continue
        if isinstance(tool.get("function"), dict):  # chat completions
            param, schema = f"tools[{index}].function.parameters", tool["function"].get("parameters")
        elif "input_schema" in tool:  # Messages
            param, schema = f"tools[{index}].input_schema", tool["input_schema"]
        else:  # Responses
            param, schema = f"tools[{index}].parameters", tool.get("parameters")
        if not isinstance(schema, dict):
            continue
        try:
            # vLLM's own guard first: compiling costs steeply more with each level of nesting.
            check_json_nesting(schema)
            xgrammar.Grammar.from_json_schema(json.dumps(schema))
        except Exception as err:  # xgrammar raises RuntimeError, its reason in the text
            return param, f"{param} cannot be compiled into a grammar: {_XGRAMMAR_PREFIX.sub('', str(err)).strip()}"
    return None


# vLLM's refusals of a grammar no backend can compile (xgrammar's words; guidance's, after vLLM's
# fallback from xgrammar, as the CPU engine answers; outlines'; its own checks of the fields) name
# no parameter.
_GRAMMAR_REFUSALS = (
    "Grammar error:", "Invalid grammar specification", "Invalid JSON grammar specification", "Failed to transform",
    "The provided JSON schema", "Choice '", "structured_outputs.", "Invalid structural tag specification",
    "No compatible structured output backend",
)
_STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "structural_tag", "json_object")


def grammar_field(body: dict) -> str | None:
    """The field the request's one grammar came from, as the client sent it: vLLM's
    ``structured_outputs``, chat's and completions' ``response_format``, a Responses
    ``text.format``, a Messages ``output_config.format``. None when the request carries several,
    or a forced tool call (whose grammar vLLM builds from the tools), or none: nothing is guessed."""
    fields = []
    if isinstance(sent := body.get("structured_outputs"), dict):
        fields += [f"structured_outputs.{key}" for key in _STRUCTURED_OUTPUTS if sent.get(key) not in (None, False)]
    if isinstance(response_format := body.get("response_format"), dict):
        kind = response_format.get("type")
        if kind == "json_schema":
            fields.append("response_format.json_schema.schema")
        elif kind == "structural_tag":
            fields.append("response_format")
    formats = ((body.get("text"), "text.format.schema"), (body.get("output_config"), "output_config.format.schema"))
    for holder, name in formats:
        fmt = holder.get("format") if isinstance(holder, dict) else None
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            fields.append(name)
    if body.get("tools") and body.get("tool_choice") not in (None, "auto", "none"):
        return None
    return fields[0] if len(fields) == 1 else None
