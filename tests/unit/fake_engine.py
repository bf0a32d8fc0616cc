"""A fake engine for the model replica's tests (``serve_app.engine.protocol.Engine``): deterministic
tokens, configurable latency, failures before or during a stream, a dead engine — no vLLM.

It answers chat like vLLM's serving layer does (the same SSE chunks, the usage chunk with
``metrics`` when usage is asked for, ``[DONE]``), through the real chat watcher
(``trailer.StreamTrailer``), and its ``generate`` is wrapped by the real token counter
(``token_count.counting``), as ``VLLMEngine`` wraps vLLM's. Responses and Messages streams are
vLLM's own events made from that generation (``fake_vllm.py``), through the real
watchers (``outputs.ResponsesStream``, ``outputs.MessagesStream``). Non-stream, the other surfaces
get small bodies of their own shape (a Responses response, an Anthropic message, a tokenization),
with the same counted generation behind the ones that generate. Embeddings come as vLLM's pooling
layer answers them (a deterministic vector per input, float or base64 little-endian float32,
``dimensions`` honoured, usage counting each input's tokens), shaped and summarised by the real
embeddings output (``outputs.EMBEDDINGS``), with engine timing from the real ``pooling_timing``.
"""

import asyncio
import base64
import dataclasses
import hashlib
import json
import struct
from types import SimpleNamespace
from typing import Any

import fake_vllm
from serve_app.engine import outputs as engine_outputs
from serve_app.engine import pooling_timing, replay, token_count, trailer
from serve_app.engine.prefetch import AHEAD, Prefetched
from serve_app.engine.protocol import Stream
from serve_app.engine.vllm_engine import _resumed, _with_room_for  # a continuation's cut, as VLLMEngine's
from serve_app.errors import error_body
from serve_app.surfaces import seam
from serve_app.wire.messages import Answer, Call, Trailer

PROMPT_TOKENS = 5
DELTA = SimpleNamespace(output_kind=SimpleNamespace(name="DELTA"))
# vLLM's serving layer runs a non-stream request final-only: one output, when it finishes.
FINAL_ONLY = SimpleNamespace(output_kind=SimpleNamespace(name="FINAL_ONLY"))
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
    ``fail_before``: raise instead of answering; ``refuse``: answer this 4xx (or (4xx, code)) instead;
    ``prompt_tokens`` / ``cached_tokens``: what each generation reports for its prompt;
    ``counted``: what /tokenize and count_tokens count (else ``TOKENIZED``'s 3); ``cuts_at_seam``:
    as ``VLLMEngine`` where a resumed tail ends inside a character, this many of its tokens are
    dropped (``replay.whole_characters``) and generated again; ``held_back``: token ids whose text
    the detokenizer holds back (the first bytes of a character: no text yet)."""

    def __init__(self, *, tokens=4, latency_s=0.0, fail_after=None, fail_before=False, dies=False, refuse=None,
                 prompt_tokens=PROMPT_TOKENS, cached_tokens=0, counted=None, cuts_at_seam=0, held_back=()):
        self.tokens, self.latency_s = tokens, latency_s
        self.fail_after, self.fail_before, self.dies, self.refuse = fail_after, fail_before, dies, refuse
        self.prompt_tokens, self.cached_tokens, self.counted = prompt_tokens, cached_tokens, counted
        self.cuts_at_seam, self.held_back = cuts_at_seam, frozenset(held_back)
        self.started = self.stopped = False
        self.dead = False
        self.generated = 0  # tokens produced, whoever was listening
        self.closed_early = 0  # generations (or embedding inputs) stopped before their end (aborted)
        self.embedded = 0  # embedding inputs the engine finished
        self.calls: list[tuple[str, Call]] = []
        # As VLLMEngine's: the count under the replay of a resumed stream's tokens.
        self.aborted: set[str] = set()  # request ids aborted through ``abort`` (AsyncLLM.abort's)
        self.generate = replay.replaying(token_count.counting(self._generate, abort=self.abort), lambda: FAKE_TOKENIZER)
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
        if call.resume is not None and self.cuts_at_seam:
            kept = call.resume.token_ids[: len(call.resume.token_ids) - self.cuts_at_seam]
            resume = dataclasses.replace(call.resume, token_ids=kept)
            call = _with_room_for(surface, dataclasses.replace(call, resume=resume), self.cuts_at_seam)
        body = dict(call.body)  # the real engine hands vLLM a copy: the router's body stays as sent
        if self.dead:  # as vLLM's, once its engine core died: every request fails
            raise EngineFailed("the engine is dead")
        if self.fail_before:
            self.dead = self.dies
            raise EngineFailed("before the answer")
        if self.refuse is not None:  # a status, or (status, code)
            status, code = self.refuse if isinstance(self.refuse, tuple) else (self.refuse, None)
            return Answer(status, error_body(status, "refused", param="messages", code=code))
        if surface == "embeddings":
            return await self._embeddings(body, call.encoded_answers)
        if surface in ("tokenize", "detokenize", "count_tokens"):
            await asyncio.sleep(self.latency_s)  # a large input's tokenization
            answer = TOKENIZED if surface == "tokenize" else {"prompt": "t1 t2"} if surface == "detokenize" else {"input_tokens": 3}
            if self.counted is not None and surface != "detokenize":
                answer = {**answer, ("count" if surface == "tokenize" else "input_tokens"): self.counted}
            return Answer(200, dict(answer), Trailer())
        limit = body.get("max_output_tokens") or body.get("max_completion_tokens") or body.get("max_tokens")
        before = len(call.resume.token_ids) if call.resume else 0  # a resumed stream's tokens so far
        wanted = min(limit or self.tokens, self.tokens - before)
        if surface in ("responses", "messages"):
            # vLLM's modules, imported on a thread the first time: seconds on a busy host, which
            # on the event loop the router shares here would time out the replica's socket.
            await asyncio.to_thread(fake_vllm.import_vllm)
        if call.resume is not None:  # the replay makes vLLM's outputs: its modules, on a thread
            await asyncio.to_thread(fake_vllm.import_vllm)
            replay.start(call.resume.token_ids, call.resume.cached_tokens)
        if surface == "responses":
            return await self._responses(call, wanted)
        # As vLLM's: the prompt, then (a resume) what was generated before the seam.
        prompt = {"prompt_token_ids": [1] * self.prompt_tokens + list(call.resume.token_ids if call.resume else ())}
        kind = DELTA if body.get("stream") else FINAL_ONLY
        outputs = self.generate(prompt, kind, call.request_id, max_tokens=wanted, first=before + 1)
        if body.get("stream") and surface == "messages":
            watcher = engine_outputs.MessagesOutput().watcher(body)
            events = fake_vllm.messages_events(_failure_as_event(self._events(outputs, body)), watcher)
            return Stream(await Prefetched.started(events), _resumed("messages", watcher, call))
        if body.get("stream"):
            watcher = trailer.StreamTrailer(trailer.ask_for_usage(body))
            events = self._events(outputs, body, surface)
            return Stream(await Prefetched.started(events), _resumed(surface, watcher, call))  # under way, as vLLM's
        text = "".join([o.outputs[0].text async for o in outputs])
        if surface == "messages":
            return fake_vllm.messages_answer(body, text, prompt_tokens=self.prompt_tokens, completion_tokens=wanted,
                                             finish_reason="length", metrics=TIMING)
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": wanted,
                 "total_tokens": self.prompt_tokens + wanted}
        output = engine_outputs.COMPLETIONS if surface == "completions" else engine_outputs.CHAT
        response = self._body(surface, call, text, usage)
        summary = output.summarize(response)  # takes `metrics` off, as the replica does
        output.shape(response, body)
        return Answer(200, response, summary)

    async def _responses(self, call: Call, wanted: int) -> Answer | Stream:
        """As ``VLLMEngine.on_responses``: vLLM validates the body, the answer is shaped against the
        client's body with the id it continued from."""
        request = fake_vllm.validated_responses_request(
            {**call.body, "request_id": f"resp_{call.request_id}", "store": False}
        )
        if isinstance(request, Answer):
            return request
        shape_body = {**call.body, "previous_response_id": call.previous_response_id}
        before = call.resume.token_ids if call.resume else ()
        outputs = self.generate({"prompt_token_ids": [1] * self.prompt_tokens + list(before)},
                                DELTA if call.stream else FINAL_ONLY, call.request_id, max_tokens=wanted,
                                first=len(before) + 1)
        counts = dict(wanted=wanted, total=self.tokens - len(before), prompt_tokens=self.prompt_tokens,
                      cached=self.cached_tokens, metrics=TIMING)
        if not call.stream:
            _ = [o async for o in outputs]  # the generation the text stands for
            return fake_vllm.responses_answer(request, shape_body, f"answer {self.count}", **counts)
        events = fake_vllm.responses_events(request, outputs, **counts)
        watcher = engine_outputs.ResponsesOutput().watcher(shape_body)
        if call.resume is not None:
            watcher = seam.ResponsesCut(call.resume.received, call.resume.ids, watcher, replay.current().is_past_seam)
        return Stream(await Prefetched.started(events, ahead=0 if call.resume else AHEAD), watcher)

    async def _embeddings(self, body: dict[str, Any], encoded: bool) -> Answer:
        """vLLM's embeddings response (its JSON, its extra id, created and usage fields included),
        answered by the replica's own output (``outputs.EmbeddingsOutput``: as JSON text when the
        router takes it); the inputs one after another through the counted ``encode``
        (``latency_s`` each)."""
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
        # As vLLM's JSONResponse renders it (starlette's, compact; ORJSONResponse when orjson is in).
        result = SimpleNamespace(body=json.dumps(response, ensure_ascii=False, separators=(",", ":")).encode())
        answer = engine_outputs.EmbeddingsOutput(encoded=encoded).answer(result, body)
        timing = pooling_timing.timing([POOLING_STATS] * len(inputs))
        return dataclasses.replace(answer, trailer=dataclasses.replace(answer.trailer, timing=timing))

    def _body(self, surface: str, call: Call, text: str, usage: dict[str, int]) -> dict[str, Any]:
        """A chat or completions body as vLLM dumps it (every field, nulls and extras included)."""
        if surface == "completions":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                      "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None}
        else:
            message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                       "function_call": None, "tool_calls": [], "reasoning": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length",
                      "stop_reason": None, "token_ids": None}
        return {"id": "cmpl-f" if surface == "completions" else "chatcmpl-f",
                "object": "text_completion" if surface == "completions" else "chat.completion",
                "created": 1, "model": call.body.get("model"), "choices": [choice], "service_tier": None,
                "system_fingerprint": None, "usage": {**usage, "prompt_tokens_details": None},
                "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None, "metrics": dict(TIMING)}

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

    async def abort(self, request_id: str) -> None:
        """As ``AsyncLLM.abort``: the request stops, and a final-only one then yields what it had."""
        self.aborted.add(request_id)

    async def _generate(self, prompt, sampling_params, request_id, *, max_tokens: int, first: int = 1):
        """Tokens ``first``, ``first + 1``… (``t<id>`` their text), ``max_tokens`` of them: one
        output per token (delta), or, final-only, one output of them all when the request ends
        (finished or aborted), as vLLM's."""
        final_only = sampling_params.output_kind.name == "FINAL_ONLY"
        produced, tokens = 0, []
        try:
            while produced < max_tokens and request_id not in self.aborted:
                if self.fail_after is not None and produced == self.fail_after:
                    self.dead = self.dies
                    raise EngineFailed("mid-stream")
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                produced += 1
                self.generated += 1
                tokens.append(first + produced - 1)
                if not final_only:
                    yield self._output(prompt, tokens[-1:])
            if final_only:
                yield self._output(prompt, tokens)
        finally:
            if produced < max_tokens and not self.dead:
                self.closed_early += 1

    def _output(self, prompt, tokens: list[int]) -> SimpleNamespace:
        text = "".join(f"t{token} " for token in tokens if token not in self.held_back)
        choice = SimpleNamespace(index=0, token_ids=list(tokens), text=text)
        return SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], num_cached_tokens=self.cached_tokens,
                               outputs=[choice])

    async def _events(self, outputs, body: dict[str, Any], surface: str = "chat"):
        """vLLM's chat (or completions) SSE strings for ``outputs``, each choice with the
        ``logprobs: null`` vLLM sets; the usage's prompt is the outputs' (as vLLM's)."""
        prompt_tokens = self.prompt_tokens
        completions = surface == "completions"
        kind = "text_completion" if completions else "chat.completion.chunk"
        chunk = {"id": "cmpl-f" if completions else "chatcmpl-f", "object": kind, "created": 1, "model": body.get("model")}

        def event(payload):
            return f"data: {json.dumps({**chunk, **payload}, separators=(',', ':'))}\n\n"

        def choice(text=None, finish=None, role=None):
            if completions:
                return {"choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}
            delta = {} if text is None else {"content": text}
            return {"choices": [{"index": 0, "delta": {"role": role, **delta} if role else delta,
                                 "logprobs": None, "finish_reason": finish}]}

        n, cached = 0, None
        try:
            async for output in outputs:
                prompt_tokens = len(output.prompt_token_ids)
                if n == 0:  # as vLLM: the cached count is the first output's
                    cached = output.num_cached_tokens
                if n == 0 and not completions:  # as vLLM: the role chunk comes with the engine's first output
                    yield event(choice("", role="assistant"))
                n += 1
                yield event(choice(output.outputs[0].text))
        finally:
            await outputs.aclose()  # closing the stream aborts the generation
        yield event(choice(finish="length"))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        if cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        yield event({"choices": [], "usage": usage, "metrics": TIMING})
        yield "data: [DONE]\n\n"


async def _failure_as_event(events):
    """As vLLM's chat stream under its Anthropic converter: an engine failure is its error event."""
    try:
        async for event in events:
            yield event
    except EngineFailed as failure:
        error = {"message": f"EngineCore failed: {failure}", "type": "InternalServerError", "param": None, "code": 500}
        yield f"data: {json.dumps({'error': error})}\n\n"


class FakeTokenizer:
    """What vLLM's incremental detokenizer asks of a tokenizer, for the fake's tokens: ``t<id> ``."""

    is_fast = True

    def __len__(self) -> int:
        return 2**20

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        return [f"t{i} " for i in ids]

    def convert_tokens_to_string(self, tokens) -> str:
        return "".join(tokens)


FAKE_TOKENIZER = FakeTokenizer()


def embedding_of(entry: str | list[int], size: int) -> list[float]:
    """A unit vector of ``size`` that depends only on ``entry``: the same text, the same vector."""
    digest = hashlib.sha256(json.dumps(entry).encode()).digest() * (size // 32 + 1)
    raw = [byte - 127.5 for byte in digest[:size]]
    norm = sum(v * v for v in raw) ** 0.5
    return [struct.unpack("<f", struct.pack("<f", v / norm))[0] for v in raw]  # float32, as vLLM's
