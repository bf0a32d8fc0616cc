"""A fake engine for the model replica's tests (``serve_app.engine.protocol.Engine``): deterministic
tokens, configurable latency, failures before or during a stream, a dead engine — no vLLM.

It answers chat like vLLM's serving layer does (the same SSE chunks, the usage chunk with
``metrics`` when usage is asked for, ``[DONE]``), through the real chat watcher
(``trailer.StreamTrailer``), and its ``generate`` is wrapped by the real token counter
(``token_count.counting``), as ``VLLMEngine`` wraps vLLM's. The other surfaces get small bodies
of their own shape (a Responses response, an Anthropic message, a tokenization), with the same
counted generation behind the ones that generate. Embeddings come as vLLM's pooling layer answers
them (a deterministic vector per input, float or base64 little-endian float32, ``dimensions``
honoured, usage counting each input's tokens), shaped and summarised by the real embeddings
output (``outputs.EMBEDDINGS``), with engine timing from the real ``pooling_timing``.
"""

import asyncio
import base64
import hashlib
import json
import struct
from types import SimpleNamespace
from typing import Any

from serve_app.engine import outputs, pooling_timing, token_count, trailer
from serve_app.engine.prefetch import Prefetched
from serve_app.engine.protocol import Stream
from serve_app.errors import error_body
from serve_app.wire.messages import Answer, Call, Trailer

PROMPT_TOKENS = 5
DELTA = SimpleNamespace(output_kind=SimpleNamespace(name="DELTA"))
TIMING = {"queue_time_ms": 1.0, "time_to_first_token_ms": 2.0, "generation_time_ms": 3.0}
TOKENIZED = {"count": 3, "max_model_len": 8192, "tokens": [1, 2, 3], "token_strs": None}
EMBEDDING_DIMENSIONS = 8
# An embedding's engine stats (vLLM's RequestStateStats timestamps, s): 1 ms queued, 4 ms computed.
POOLING_STATS = SimpleNamespace(queued_ts=10.0, scheduled_ts=10.001, last_token_ts=10.005)


class EngineFailed(Exception):
    pass


class FakeEngine:
    """``tokens``: how many a request gets unless its limit says fewer; ``latency_s``: between
    tokens; ``fail_after``: raise after that many tokens (``dies``: the engine is dead then);
    ``fail_before``: raise instead of answering; ``refuse``: answer this 4xx instead;
    ``prompt_tokens`` / ``cached_tokens``: what each generation reports for its prompt."""

    def __init__(self, *, tokens=4, latency_s=0.0, fail_after=None, fail_before=False, dies=False, refuse=None,
                 prompt_tokens=PROMPT_TOKENS, cached_tokens=0):
        self.tokens, self.latency_s = tokens, latency_s
        self.fail_after, self.fail_before, self.dies, self.refuse = fail_after, fail_before, dies, refuse
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens
        self.started = self.stopped = False
        self.dead = False
        self.generated = 0  # tokens produced, whoever was listening
        self.closed_early = 0  # generations (or embedding inputs) stopped before their end (aborted)
        self.embedded = 0  # embedding inputs the engine finished
        self.calls: list[tuple[str, Call]] = []
        self.generate = token_count.counting(self._generate)
        self.encode = token_count.counting_encode(self._encode)

    @property
    def bodies(self) -> list[tuple[str, dict[str, Any]]]:
        """Each request's surface and body, as the replica got them."""
        return [(surface, call.body) for surface, call in self.calls]

    @property
    def count(self) -> int:
        return len(self.calls)

    async def start(self) -> None:
        self.started = True

    async def check_health(self) -> None:
        if self.dead:
            raise EngineFailed("dead")

    def unfinished_requests(self) -> int:
        return 0

    def shutdown(self) -> None:
        self.stopped = True

    async def answer(self, surface: str, call: Call) -> Answer | Stream:
        self.calls.append((surface, call))
        body = call.body
        if self.fail_before:
            self.dead = self.dies
            raise EngineFailed("before the answer")
        if self.refuse is not None:
            return Answer(self.refuse, error_body(self.refuse, "refused", param="messages"))
        if surface == "embeddings":
            return await self._embeddings(body)
        if surface in ("tokenize", "detokenize", "count_tokens"):
            answer = TOKENIZED if surface == "tokenize" else {"prompt": "t1 t2"} if surface == "detokenize" else {"input_tokens": 3}
            return Answer(200, dict(answer), Trailer())
        limit = body.get("max_output_tokens") or body.get("max_completion_tokens") or body.get("max_tokens")
        wanted = min(limit or self.tokens, self.tokens)
        outputs = self.generate([1] * self.prompt_tokens, DELTA, call.request_id, max_tokens=wanted)
        if body.get("stream"):
            watcher = trailer.StreamTrailer(trailer.ask_for_usage(body))
            return Stream(Prefetched(self._events(outputs, body)), watcher)  # under way, as vLLM's
        text = "".join([o.outputs[0].text async for o in outputs])
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": wanted,
                 "total_tokens": self.prompt_tokens + wanted}
        summary = Trailer(timing=trailer.engine_timing(TIMING), usage=usage, finish_reasons=("length",))
        return Answer(200, self._body(surface, call, text, usage), summary)

    async def _embeddings(self, body: dict[str, Any]) -> Answer:
        """vLLM's embeddings body (its extra id, created and usage fields included), then shaped;
        the inputs one after another through the counted ``encode`` (``latency_s`` each)."""
        value = body["input"]
        inputs = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
        size = body.get("dimensions") or EMBEDDING_DIMENSIONS
        data = []
        for index, entry in enumerate(inputs):
            tokens = entry if isinstance(entry, list) else [1] * len(entry.split())
            async for _ in self.encode(prompt=tokens, request_id=f"embd-{index}"):
                pass
            vector = embedding_of(entry, size)
            if body.get("encoding_format") == "base64":
                vector = base64.b64encode(struct.pack(f"<{size}f", *vector)).decode()
            data.append({"index": index, "object": "embedding", "embedding": vector})
        tokens = sum(len(entry) if isinstance(entry, list) else len(entry.split()) for entry in inputs)
        response = {"id": "embd-f", "object": "list", "created": 1, "model": body.get("model"), "data": data,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                              "prompt_tokens_details": None}}
        summary = outputs.EMBEDDINGS.summarize(response)
        outputs.EMBEDDINGS.shape(response, body)
        timing = pooling_timing.timing([POOLING_STATS] * len(inputs))
        return Answer(200, response, Trailer(timing=timing, usage=summary.usage))

    def _body(self, surface: str, call: Call, text: str, usage: dict[str, int]) -> dict[str, Any]:
        model = call.body.get("model")
        if surface == "responses":
            return {
                "id": f"resp_{call.request_id}", "object": "response", "status": "completed", "model": model,
                "created_at": 1, "previous_response_id": call.previous_response_id,
                "output": [{"type": "message", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": f"answer {self.count}"}]}],
                "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]},
            }
        if surface == "messages":
            return {"id": "msg_1", "type": "message", "role": "assistant", "model": model,
                    "content": [{"type": "text", "text": text}],
                    "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}
        return {"id": "chatcmpl-f", "object": "chat.completion", "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
                "usage": usage}

    async def _encode(self, *, prompt, request_id):
        """One input's forward pass, as vLLM's ``encode`` yields it: one finished output."""
        try:
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
            self.embedded += 1
            yield SimpleNamespace(prompt_token_ids=prompt, num_cached_tokens=self.cached_tokens, finished=True)
        except BaseException:
            self.closed_early += 1
            raise

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
                yield SimpleNamespace(prompt_token_ids=prompt, num_cached_tokens=self.cached_tokens, outputs=[choice])
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
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}
        yield event({"choices": [], "usage": usage, "metrics": TIMING})
        yield "data: [DONE]\n\n"


def embedding_of(entry: str | list[int], size: int) -> list[float]:
    """A unit vector of ``size`` that depends only on ``entry``: the same text, the same vector."""
    digest = hashlib.sha256(json.dumps(entry).encode()).digest() * (size // 32 + 1)
    raw = [byte - 127.5 for byte in digest[:size]]
    norm = sum(v * v for v in raw) ** 0.5
    return [struct.unpack("<f", struct.pack("<f", v / norm))[0] for v in raw]  # float32, as vLLM's
