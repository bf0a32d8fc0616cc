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
    if (over_cap := rendered.over_request_cap(error)) is not None:
        return Answer(error.code, error_body(error.code, over_cap, param="input", code=rendered.MAX_TOKENS_PER_REQUEST))
    if not rendered.is_context_overflow(error):
        if message.startswith(_UNREADABLE_TOOL_GRAMMAR) and body.get("tools"):  # the tools' grammar (or merged)
            if found := _uncompilable_tool_schema(body.get("tools")):
                param, message = found
        elif param is None and message.startswith(_GRAMMAR_REFUSALS):
            param = grammar_field(body, message)
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
# fallback from xgrammar, as the CPU engine answers; outlines'; its own checks) name no parameter.
_GRAMMAR_REFUSALS = (
    "Grammar error:", "Invalid grammar specification", "Invalid JSON grammar specification", "Failed to transform",
    "The provided JSON schema", "The JSON schema is nested too deeply", "Choice '", "structured_outputs.",
    "Invalid structural tag specification", "No compatible structured output backend", "Error parsing regex",
    "Regex uses unsupported feature", "Regex does not have a anchored", "Error serializing structured outputs",
)
# vLLM's own checks of one field name it in their words ("structured_outputs.regex must not ...").
_NAMED_FIELD = re.compile(r"^(structured_outputs\.[a-z_]+)\b")


def grammar_field(body: dict, message: str = "") -> str | None:
    """The field the request's one grammar came from, as the client sent it: vLLM's
    ``structured_outputs`` (one key of it, or the one vLLM's message names), chat's and
    completions' ``response_format``, a Responses ``text.format``. None whenever it could be
    another: more than one of these in the request, or tools the model may call (vLLM merges the
    format into the tools' grammar), or none: nothing is guessed. (Messages' ``output_config``
    is never named: Anthropic's error shape has no ``param``.)"""
    if body.get("tools") and body.get("tool_choice") != "none":
        return None
    named = _NAMED_FIELD.match(message)
    sources: list[tuple[str, str | None]] = []  # (where, the field when it can be told)
    if isinstance(sent := body.get("structured_outputs"), dict) and sent:
        keys = [key for key, value in sent.items() if value not in (None, False)]
        field = named.group(1) if named else f"structured_outputs.{keys[0]}" if len(keys) == 1 else None
        sources.append(("structured_outputs", field))
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text", "json_object"):
        json_schema = response_format.get("type") == "json_schema"
        sources.append(("response_format", "response_format.json_schema.schema" if json_schema else "response_format"))
    fmt = body["text"].get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text", "json_object"):
        sources.append(("text", "text.format.schema" if fmt.get("type") == "json_schema" else "text.format"))
    if isinstance(output_config := body.get("output_config"), dict) and output_config.get("format"):
        sources.append(("output_config", None))
    if len(sources) != 1 or (named and sources[0][0] != "structured_outputs"):
        return None
    return sources[0][1]
