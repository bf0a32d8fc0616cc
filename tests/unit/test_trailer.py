"""The replica's trailer: engine timing and usage peeled off vLLM's output, the client's view kept."""

import json

from serve_app.engine import trailer
from serve_app.wire.messages import EngineTiming, Trailer

METRICS = {"queue_time_ms": 1.5, "time_to_first_token_ms": 20.0, "generation_time_ms": 80.0, "tokens_per_second": 9}
DELTA = 'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
FINAL = 'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
USAGE = "data: " + json.dumps(
    {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}, "metrics": METRICS},
    separators=(",", ":"),
) + "\n\n"


def test_ask_for_usage_forces_usage_and_reports_what_the_client_wanted():
    body = {"stream": True}
    assert trailer.ask_for_usage(body) is False
    assert body["stream_options"] == {"include_usage": True}
    body = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert trailer.ask_for_usage(body) is True
    assert body["stream_options"]["continuous_usage_stats"] is True


def run(watcher, events):
    return [out for e in events if (out := watcher.pass_on(e)) is not None]


def test_stream_without_usage_request_hides_the_usage_chunk_and_done():
    watcher = trailer.StreamTrailer(client_wants_usage=False)
    assert run(watcher, [DELTA, FINAL, USAGE, "data: [DONE]\n\n"]) == [DELTA, FINAL]
    assert watcher.trailer() == Trailer(
        timing=EngineTiming(queue_ms=1.5, prefill_ms=20.0, decode_ms=80.0),
        usage={"prompt_tokens": 3, "completion_tokens": 2},
        finish_reasons=("length",),
        error_code=None,
        error_status=None,
    )


def test_stream_with_usage_request_keeps_usage_but_never_metrics():
    watcher = trailer.StreamTrailer(client_wants_usage=True)
    out = run(watcher, [DELTA, FINAL, USAGE, "data: [DONE]\n\n"])
    assert out[:2] == [DELTA, FINAL]
    usage_chunk = json.loads(out[2][len("data: "):])
    assert usage_chunk["usage"]["completion_tokens"] == 2
    assert "metrics" not in usage_chunk
    assert len(out) == 3


def test_non_stream_response_trailer_removes_metrics():
    body = {"choices": [{"finish_reason": "stop"}], "usage": {"completion_tokens": 4}, "metrics": METRICS}
    summary = trailer.from_response(body)
    assert "metrics" not in body
    assert summary.timing.prefill_ms == 20.0
    assert summary.finish_reasons == ("stop",)


def test_missing_metrics_give_empty_timing():
    assert trailer.engine_timing(None) == EngineTiming(queue_ms=None, prefill_ms=None, decode_ms=None)


def test_an_engine_failure_mid_stream_is_held_back_for_the_router_to_end_or_resume():
    watcher = trailer.StreamTrailer(client_wants_usage=False)
    vllm_error = (
        'data: {"error":{"message":"EngineCore encountered an issue. See stack trace (above) for the root '
        'cause.","type":"InternalServerError","param":null,"code":500}}\n\n'
    )
    # Not passed on: vLLM's words stay in the log, and the router either resumes the stream on
    # another replica or ends it with its own engine_unavailable event (test_model_server).
    assert watcher.pass_on(vllm_error) is None
    ended = watcher.trailer()
    assert (ended.complete, ended.error_code) == (False, "engine_unavailable")


def test_a_client_error_mid_stream_keeps_its_status_and_message():
    watcher = trailer.StreamTrailer(client_wants_usage=False)
    event = watcher.pass_on('data: {"error":{"message":"bad grammar","type":"BadRequestError","param":"x","code":400}}\n\n')
    error = json.loads(event[5:])["error"]
    assert (error["type"], error["message"], error["param"]) == ("invalid_request_error", "bad grammar", "x")
    assert watcher.trailer().error_code == "invalid_request"
    assert watcher.trailer().error_status == 400


def test_token_events_are_passed_on_untouched():
    watcher = trailer.StreamTrailer(client_wants_usage=False)
    event = 'data: {"id":"c","choices":[{"index":0,"delta":{"content":"error"}}]}\n\n'
    assert watcher.pass_on(event) is event and watcher.trailer().error_code is None


def test_vllm_only_nulls_are_cut_from_chunks_and_asked_for_values_kept():
    watcher = trailer.StreamTrailer(client_wants_usage=False)
    first = ('data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
             '"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}\n\n')
    delta = 'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
    last = ('data: {"id":"c","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"stop","stop_reason":null,'
            '"prompt_token_ids":null,"token_ids":null}]}\n\n')
    asked = 'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"},"finish_reason":"stop","stop_reason":"END","token_ids":[7]}]}\n\n'
    out = run(watcher, [first, delta, last, asked])
    parsed = [json.loads(event[len("data: "):]) for event in out]
    assert "prompt_token_ids" not in parsed[0] and "prompt_text" not in parsed[0]
    assert parsed[1]["choices"][0] == {"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None}
    assert set(parsed[2]["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    assert out[3] == asked  # a stop string the caller set, token ids the caller asked for


def test_a_chat_chunks_logprobs_get_the_refusal_the_spec_requires():
    watcher = trailer.StreamTrailer(client_wants_usage=False)
    chunk = 'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"},"logprobs":{"content":[{"token":"a","logprob":-1.0,"bytes":[97],"top_logprobs":[]}]},"finish_reason":null}]}\n\n'
    (out,) = run(watcher, [chunk])
    logprobs = json.loads(out[len("data: "):])["choices"][0]["logprobs"]
    assert logprobs["refusal"] is None and logprobs["content"][0]["token"] == "a"


def test_echoed_prompt_token_ids_are_dropped_unless_asked_for():
    chunk = 'data: {"id":"c","choices":[{"index":0,"text":"Hi","logprobs":null,"finish_reason":null,"prompt_token_ids":[5,6]}]}\n\n'
    (out,) = run(trailer.StreamTrailer(client_wants_usage=False), [chunk])
    assert json.loads(out[len("data: "):])["choices"][0] == {"index": 0, "text": "Hi", "logprobs": None, "finish_reason": None}
    (kept,) = run(trailer.StreamTrailer(client_wants_usage=False, token_ids_asked=True), [chunk])
    assert json.loads(kept[len("data: "):])["choices"][0]["prompt_token_ids"] == [5, 6]
