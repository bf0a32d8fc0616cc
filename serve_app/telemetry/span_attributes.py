"""What a request's spans say: the OpenTelemetry GenAI semantic conventions' attributes of the
request and its answer, the routing decision, and the server-side timing split (never prompt or
completion text, never a credential)."""

from typing import Any

from serve_app.telemetry.timing import RequestRecord, Split


def genai_attributes(record: RequestRecord) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": record.operation,
        "gen_ai.provider.name": "vllm",
        **record.request_params,
    }
    if record.alias is not None:
        attributes["gen_ai.request.model"] = record.alias
    if record.model is not None:
        attributes["gen_ai.response.model"] = record.model
    if record.input_tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = record.input_tokens
    if record.output_tokens is not None:
        attributes["gen_ai.usage.output_tokens"] = record.output_tokens
    if record.cached_tokens is not None:  # OpenTelemetry's GenAI name (incubating): part of input_tokens
        attributes["gen_ai.usage.cache_read.input_tokens"] = record.cached_tokens
    if record.finish_reasons:
        attributes["gen_ai.response.finish_reasons"] = list(record.finish_reasons)
    if record.response_id is not None:
        attributes["gen_ai.response.id"] = record.response_id
    if record.model_replica is not None:
        attributes["serve_app.model_replica"] = record.model_replica
    return attributes


def routing_attributes(record: RequestRecord) -> dict[str, Any]:
    """The model deployment's request router's decision (docs/operations.md, "Request routing")."""
    decision = record.routing
    if decision is None:
        return {}
    return {
        "serve_app.routing.policy": decision.policy,
        "serve_app.routing.reason": decision.reason,
        "serve_app.routing.replica": decision.replica,
        "serve_app.routing.matched_chars": decision.matched_chars,
        "serve_app.routing.prompt_chars": decision.prompt_chars,
    }


def inference_attributes(split: Split) -> dict[str, Any]:
    attributes: dict[str, Any] = {"serve_app.inference_ms": split.inference_ms}
    for key, value in (
        ("serve_app.prefill_ms", split.prefill_ms),
        ("serve_app.decode_ms", split.decode_ms),
        ("serve_app.tokens_per_s", split.tokens_per_s),
        ("serve_app.time_per_output_token_ms", split.time_per_output_token_ms),
    ):
        if value is not None:
            attributes[key] = value
    return attributes


def server_attributes(record: RequestRecord, split: Split) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        **genai_attributes(record),
        **routing_attributes(record),
        "http.response.status_code": record.status,
        "serve_app.stream": record.stream,
        "serve_app.server_ms": split.server_ms,
        "serve_app.network_ms": split.network_ms,
        "serve_app.queue_ms": split.queue_ms,
        "serve_app.inference_ms": split.inference_ms,
        "serve_app.engine_timing": split.engine,
    }
    if record.alias is not None:
        attributes["serve_app.alias"] = record.alias
    if record.failover_reason is not None:
        attributes["serve_app.failover.reason"] = record.failover_reason
        attributes["serve_app.served_by_region"] = record.failover_region or record.region
    if split.ttft_ms is not None:
        attributes["serve_app.ttft_ms"] = split.ttft_ms
    if split.tokens_per_s is not None:
        attributes["serve_app.tokens_per_s"] = split.tokens_per_s
    if split.clamped:
        attributes["serve_app.timing_clamped"] = True
    if split.unreported_engine_ms:  # inference measured by the router: the engine reported nothing
        attributes["serve_app.unreported_engine_ms"] = split.unreported_engine_ms
    if record.status >= 400:
        attributes["error.type"] = record.error_type or str(record.status)
    return attributes
