"""Response and chunk types, shaped like the openai SDK's so code reads the same with either.

Every model allows extra fields: vLLM and this server add some (``reasoning_content``,
``stop_reason``, a model card's ``state``/``region``), and a newer server must not break an older
client. Fields the server may omit default to None or empty, never a validation error.

Non-stream answers carry the server's timing as ``.timing`` (a ``ServerTiming``), kept in a
private attribute so ``model_dump()`` returns the server's body as it came.
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

from serve_app.client.timing import ServerTiming


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class CompletionUsage(_Open):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None


class FunctionCall(_Open):
    name: str | None = None
    arguments: str | None = None


class ToolCall(_Open):
    id: str | None = None
    type: str | None = "function"
    function: FunctionCall = FunctionCall()


class ChoiceDeltaToolCall(ToolCall):
    index: int = 0


class _Said(_Open):
    """What an assistant turn holds: a whole message, or one delta of it in a stream."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None


class ChoiceDelta(_Said):
    tool_calls: list[ChoiceDeltaToolCall] | None = None


class ChatCompletionMessage(_Said):
    role: str | None = "assistant"
    tool_calls: list[ToolCall] | None = None


class _Choice(_Open):
    index: int = 0
    finish_reason: str | None = None
    logprobs: Any = None


class ChunkChoice(_Choice):
    delta: ChoiceDelta = ChoiceDelta()


class Choice(_Choice):
    message: ChatCompletionMessage = ChatCompletionMessage()


class CompletionChoice(_Choice):
    text: str = ""


class _Answer(_Open):
    """The envelope every answer and chunk has; ``object`` and ``choices`` differ per kind."""

    id: str | None = None
    created: int | None = None
    model: str | None = None
    usage: CompletionUsage | None = None


class _TimedAnswer(_Answer):
    _timing: ServerTiming | None = PrivateAttr(default=None)

    @property
    def timing(self) -> ServerTiming | None:
        """The server's timing, region and trace id for this response (docs/client.md)."""
        return self._timing


class ChatCompletionChunk(_Answer):
    object: str = "chat.completion.chunk"
    choices: list[ChunkChoice] = []


class ChatCompletion(_TimedAnswer):
    object: str = "chat.completion"
    choices: list[Choice] = []


# A completions stream's chunks have the answer's fields (``text`` per choice), without timing.
class CompletionChunk(_Answer):
    object: str = "text_completion"
    choices: list[CompletionChoice] = []


class Completion(_TimedAnswer):
    object: str = "text_completion"
    choices: list[CompletionChoice] = []


class Model(_Open):
    """A model card (``GET /v1/models``): ``state``, ``aliases``, ``region`` and the rest are extras."""

    id: str
    object: str = "model"
    created: int | None = None
    owned_by: str | None = None


class ModelList(_Open):
    object: str = "list"
    data: list[Model] = []


class Embedding(_Open):
    """One input's vector: floats, or the server's base64 string when asked for base64."""

    object: str = "embedding"
    index: int = 0
    embedding: list[float] | str = []


class EmbeddingUsage(_Open):
    prompt_tokens: int | None = None
    total_tokens: int | None = None


class CreateEmbeddingResponse(_Open):
    """``POST /v1/embeddings``: OpenAI's response, with the server's timing as ``.timing``."""

    object: str = "list"
    data: list[Embedding] = []
    model: str | None = None
    usage: EmbeddingUsage | None = None
    _timing: ServerTiming | None = PrivateAttr(default=None)

    @property
    def timing(self) -> ServerTiming | None:
        """The server's timing, region and trace id for this response (docs/client.md)."""
        return self._timing
