"""What ``serve-app gpu-smoke`` checks: the GPU, then one chat, one tool call and one json_schema
request through the router with the official ``openai`` SDK (an embedding model: one embeddings
request instead).

Every check returns a ``Check`` (never raises for a failed check). The CUDA check takes the torch
module and the request checks take the SDK's response objects, so the unit tests run them on
fakes and canned responses; torch and openai are imported only when a real run needs them.
"""

import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from serve_app.regions.schema import BLACKWELL_CAPABILITY


CHAT_PROMPT = "Say hi in one short sentence."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name."}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOL_PROMPT = "What is the weather in Montreal right now? Use the get_weather tool."
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}
JSON_PROMPT = "Give the city, country and approximate population of Montreal."


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    ttft_ms: float | None = None
    tokens_per_s: float | None = None

    def line(self) -> str:
        timing = ""
        if self.ttft_ms is not None:
            timing += f"  TTFT {self.ttft_ms:.0f} ms"
        if self.tokens_per_s is not None:
            timing += f"  {self.tokens_per_s:.1f} tok/s"
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.name}: {self.detail}{timing}"


def check_cuda(accelerator_type: str, torch: Any = None) -> Check:
    """torch sees a CUDA GPU of the region's Blackwell type (by compute capability)."""
    if torch is None:
        try:
            import torch  # the image's CUDA build; never imported by the router or the tests
        except ImportError:
            return Check("cuda", False, "torch is not installed here (outside the image: --skip-cuda)")
    if not torch.cuda.is_available():
        return Check("cuda", False, f"torch {torch.__version__} sees no CUDA device (driver, device plugin, "
                                    "nvidia.com/gpu limit?)")
    name = torch.cuda.get_device_name(0)
    capability = tuple(torch.cuda.get_device_capability(0))
    detail = (f"{torch.cuda.device_count()} x {name}, compute capability {capability[0]}.{capability[1]}, "
              f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    wanted = BLACKWELL_CAPABILITY.get(accelerator_type)
    if wanted is None:
        return Check("cuda", False, f"{detail}; {accelerator_type!r} is not a Blackwell type this knows")
    if capability != wanted:
        return Check("cuda", False, f"{detail}; the region pins {accelerator_type} "
                                    f"(compute capability {wanted[0]}.{wanted[1]})")
    return Check("cuda", True, detail)


def measure_stream(timed_chunks: Iterable[tuple[float, Any]], started: float) -> Check:
    """A streamed chat: text arrives, the stream finishes, usage counts the tokens. ``timed_chunks``
    are the SDK's chunks with the ``time.perf_counter()`` each arrived at."""
    first = last = None
    text, finish, tokens, server = [], None, None, {}
    for at, chunk in timed_chunks:
        server = getattr(chunk, "pg_metadata", None) or server  # our final event (docs/api.md)
        usage = getattr(chunk, "usage", None)
        if usage is not None:
            tokens = usage.completion_tokens
        for choice in getattr(chunk, "choices", None) or []:
            if choice.delta.content:
                text.append(choice.delta.content)
                first = at if first is None else first
                last = at
            finish = choice.finish_reason or finish
    content = "".join(text).strip()
    if first is None or not content:
        return Check("chat", False, "no content streamed")
    if finish is None or tokens is None:
        return Check("chat", False, f"stream ended without a finish_reason or usage: {content[:80]!r}")
    decode_s = last - first
    rate = (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else None
    served = f", server TTFT {server['inference_ttft_ms']:.0f} ms" if "inference_ttft_ms" in server else ""
    return Check("chat", True, f"{tokens} tokens, finish {finish}{served}: {content[:80]!r}",
                 ttft_ms=(first - started) * 1000, tokens_per_s=rate)


def check_tool_call(completion: Any) -> Check:
    """The model called get_weather, and the tool parser returned JSON arguments with a city."""
    choice = completion.choices[0]
    calls = choice.message.tool_calls or []
    if not calls:
        return Check("tool call", False, f"no tool call (finish {choice.finish_reason}): "
                                         f"{(choice.message.content or '')[:80]!r}")
    call = calls[0].function
    if call.name != "get_weather":
        return Check("tool call", False, f"called {call.name!r}, not get_weather")
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return Check("tool call", False, f"arguments are not JSON: {call.arguments[:80]!r}")
    if not isinstance(arguments, dict) or not isinstance(arguments.get("city"), str):
        return Check("tool call", False, f"arguments do not match the schema: {call.arguments[:80]!r}")
    return Check("tool call", True, f"get_weather({call.arguments}), finish {choice.finish_reason}")


def check_json_schema(completion: Any) -> Check:
    """The content is a JSON object with exactly the schema's keys, of the schema's types."""
    content = completion.choices[0].message.content or ""
    try:
        value = json.loads(content)
    except ValueError:
        return Check("json_schema", False, f"not JSON: {content[:80]!r}")
    types = {"string": str, "integer": int}
    wanted = {key: types[spec["type"]] for key, spec in CITY_SCHEMA["properties"].items()}
    if not isinstance(value, dict) or set(value) != set(wanted):
        return Check("json_schema", False, f"keys differ from the schema: {content[:80]!r}")
    wrong = [key for key, kind in wanted.items() if not isinstance(value[key], kind) or isinstance(value[key], bool)]
    if wrong:
        return Check("json_schema", False, f"{', '.join(wrong)} of the wrong type: {content[:80]!r}")
    return Check("json_schema", True, content[:80])


EMBED_INPUTS = ["Montreal is a city in Quebec.", "The weather in Montreal is cold in winter."]


def check_embeddings(response: Any, dimensions: int | None) -> Check:
    """One finite, non-zero vector per input, each of the model's dimensions."""
    vectors = [item.embedding for item in sorted(response.data, key=lambda item: item.index)]
    if len(vectors) != len(EMBED_INPUTS):
        return Check("embeddings", False, f"{len(vectors)} vectors for {len(EMBED_INPUTS)} inputs")
    sizes = {len(vector) for vector in vectors}
    if len(sizes) != 1 or (dimensions is not None and sizes != {dimensions}):
        return Check("embeddings", False, f"vectors of {sorted(sizes)} dimensions; the model's: {dimensions}")
    if any(not all(math.isfinite(x) for x in vector) or not any(vector) for vector in vectors):
        return Check("embeddings", False, "a vector is zero or not finite")
    return Check("embeddings", True, f"{len(vectors)} vectors of {sizes.pop()} dimensions")


def run_requests(client: Any, model: str, clock: Callable[[], float] = time.perf_counter) -> list[Check]:
    """The requests for ``model``'s task through ``client`` (an ``openai.OpenAI`` at the router's
    /v1): an embedding model embeds (it would refuse a chat), any other chats, calls a tool and
    answers a json_schema."""
    import openai

    from serve_app import catalog

    entry = catalog.get(model)
    if entry.task == "embed":
        try:
            return [check_embeddings(client.embeddings.create(model=model, input=EMBED_INPUTS),
                                     entry.embedding_dimensions)]
        except openai.OpenAIError as err:
            return [Check("embeddings", False, f"{type(err).__name__}: {err}")]
    checks = []
    try:
        started = clock()
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": CHAT_PROMPT}], max_tokens=64,
            stream=True, stream_options={"include_usage": True},
        )
        checks.append(measure_stream(((clock(), chunk) for chunk in stream), started))
    except openai.OpenAIError as err:
        checks.append(Check("chat", False, f"{type(err).__name__}: {err}"))
    requests = [
        (check_tool_call, "tool call",
         {"messages": [{"role": "user", "content": TOOL_PROMPT}], "tools": [WEATHER_TOOL], "tool_choice": "auto"}),
        (check_json_schema, "json_schema",
         {"messages": [{"role": "user", "content": JSON_PROMPT}],
          "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA,
                                                                     "strict": True}}}),
    ]
    for check, name, body in requests:
        try:
            checks.append(check(client.chat.completions.create(model=model, max_tokens=256, **body)))
        except openai.OpenAIError as err:
            checks.append(Check(name, False, f"{type(err).__name__}: {err}"))
    return checks
