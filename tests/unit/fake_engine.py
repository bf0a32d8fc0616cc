"""A fake engine for the model replica's tests (``serve_app.engine.protocol.Engine``): deterministic
tokens, configurable latency, failures before or during a stream, a dead engine — no vLLM.

It answers chat like vLLM's serving layer does (the same SSE chunks, the usage chunk with
``metrics`` when usage is asked for, ``[DONE]``), through the real chat watcher
(``trailer.StreamTrailer``), and its ``generate`` is wrapped by the real token counter
(``token_count.counting``), as ``VLLMEngine`` wraps vLLM's.
"""

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from serve_app.engine import token_count, trailer
from serve_app.engine.protocol import Answer, Stream
from serve_app.engine.stream_server import Prefetched
from serve_app.errors import error_body

PROMPT_TOKENS = 5
DELTA = SimpleNamespace(output_kind=SimpleNamespace(name="DELTA"))
TIMING = {"queue_time_ms": 1.0, "time_to_first_token_ms": 2.0, "generation_time_ms": 3.0}


class EngineFailed(Exception):
    pass


class FakeEngine:
    """``tokens``: how many a request gets unless its ``max_tokens`` says fewer; ``latency_s``:
    between tokens; ``fail_after``: raise after that many tokens (``dies``: the engine is dead
    then); ``fail_before``: raise instead of answering; ``refuse``: answer this 4xx instead."""

    def __init__(self, *, tokens=4, latency_s=0.0, fail_after=None, fail_before=False, dies=False, refuse=None):
        self.tokens, self.latency_s = tokens, latency_s
        self.fail_after, self.fail_before, self.dies, self.refuse = fail_after, fail_before, dies, refuse
        self.started = self.stopped = False
        self.dead = False
        self.generated = 0  # tokens produced, whoever was listening
        self.closed_early = 0  # generations stopped before their end (aborted requests)
        self.bodies: list[tuple[str, dict]] = []
        self.generate = token_count.counting(self._generate)

    async def start(self) -> None:
        self.started = True

    async def check_health(self) -> None:
        if self.dead:
            raise EngineFailed("dead")

    def unfinished_requests(self) -> int:
        return 0

    def shutdown(self) -> None:
        self.stopped = True

    async def serve(self, method: str, body: dict[str, Any]) -> Answer | Stream:
        self.bodies.append((method, body))
        if self.fail_before:
            self.dead = self.dies
            raise EngineFailed("before the answer")
        if self.refuse is not None:
            return Answer(self.refuse, error_body(self.refuse, "refused", param="messages"))
        wanted = min(body.get("max_tokens") or self.tokens, self.tokens)
        outputs = self.generate([1] * PROMPT_TOKENS, DELTA, "req", max_tokens=wanted)
        if not body.get("stream"):
            text = "".join([o.outputs[0].text async for o in outputs])
            usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": wanted, "total_tokens": PROMPT_TOKENS + wanted}
            answer = {"id": "chatcmpl-f", "object": "chat.completion", "model": body.get("model"),
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
                      "usage": usage}
            return Answer(200, answer, {"engine_timing": trailer.engine_timing(TIMING), "usage": usage,
                                        "finish_reasons": ["length"]})
        watcher = trailer.StreamTrailer(trailer.ask_for_usage(body))
        return Stream(Prefetched(self._events(outputs, body)), watcher)  # under way, as vLLM's

    async def _generate(self, prompt, sampling_params, request_id, *, max_tokens: int):
        produced = 0
        try:
            while produced < max_tokens:
                if self.fail_after is not None and produced == self.fail_after:
                    self.dead = self.dies
                    raise EngineFailed("mid-stream")
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                produced += 1
                self.generated += 1
                choice = SimpleNamespace(index=0, token_ids=[produced], text=f"t{produced} ")
                yield SimpleNamespace(prompt_token_ids=prompt, num_cached_tokens=0, outputs=[choice])
        finally:
            if produced < max_tokens and not self.dead:
                self.closed_early += 1

    async def _events(self, outputs, body: dict[str, Any]):
        """vLLM's chat SSE strings for ``outputs``."""
        chunk = {"id": "chatcmpl-f", "object": "chat.completion.chunk", "created": 1, "model": body.get("model")}

        def event(payload):
            return f"data: {json.dumps({**chunk, **payload}, separators=(',', ':'))}\n\n"

        n = 0
        try:
            async for output in outputs:
                if n == 0:  # as vLLM: the role chunk comes with the engine's first output
                    yield event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None}]})
                n += 1
                yield event({"choices": [{"index": 0, "delta": {"content": output.outputs[0].text},
                                          "finish_reason": None}]})
        finally:
            await outputs.aclose()  # closing the stream aborts the generation
        yield event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n, "total_tokens": PROMPT_TOKENS + n}
        yield event({"choices": [], "usage": usage, "metrics": TIMING})
        yield "data: [DONE]\n\n"
