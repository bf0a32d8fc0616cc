"""Response and chunk types, shaped like the openai SDK's (and, for Messages, the anthropic SDK's)
so code reads the same with either.

Every model allows extra fields: vLLM and this server add some (``reasoning_content``,
``stop_reason``, a model card's ``state``/``region``), and a newer server must not break an older
client. Fields the server may omit default to None or empty, never a validation error.

Non-stream answers (and a Responses stream's final response) carry the server's timing as
``.timing`` (a ``ServerTiming``), kept in a private attribute so ``model_dump()`` returns the
server's body as it came.
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


class Timed(_Open):
    """An answer with the server's timing (``.timing``), set by the client once it has the headers."""

    _timing: ServerTiming | None = PrivateAttr(default=None)

    @property
    def timing(self) -> ServerTiming | None:
        """The server's timing, region and trace id for this response (docs/client.md)."""
        return self._timing

    def stamp(self, timing: ServerTiming) -> None:
        """The client sets it once it has the server's headers (or a stream's last event)."""
        self._timing = timing


class _Answer(_Open):
    """The envelope every answer and chunk has; ``object`` and ``choices`` differ per kind."""

    id: str | None = None
    created: int | None = None
    model: str | None = None
    usage: CompletionUsage | None = None


class _TimedAnswer(_Answer, Timed):
    pass


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


# --- Responses (``POST /v1/responses``) -----------------------------------------------------------


class ResponseUsage(_Open):
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None


class ResponseContent(_Open):
    """A part of an output item (``output_text``, ``reasoning_text``, ``refusal``…)."""

    type: str | None = None
    text: str | None = None


class ResponseOutputItem(_Open):
    """An output item: a ``message`` (its ``content``), a ``function_call``, ``reasoning``…"""

    type: str | None = None
    id: str | None = None
    role: str | None = None
    status: str | None = None
    content: list[ResponseContent] | None = None
    name: str | None = None
    call_id: str | None = None
    arguments: str | None = None


class Response(Timed):
    id: str | None = None
    object: str = "response"
    status: str | None = None
    model: str | None = None
    created_at: int | None = None
    output: list[ResponseOutputItem] = []
    usage: ResponseUsage | None = None
    previous_response_id: str | None = None

    @property
    def output_text(self) -> str:
        """The text of every ``output_text`` part of the message items, joined (as the openai SDK's)."""
        return "".join(
            part.text or "" for item in self.output if item.type == "message"
            for part in item.content or () if part.type == "output_text"
        )


class ResponseStreamEvent(_Open):
    """One Responses stream event; the fields its ``type`` has are set (``delta`` on the deltas,
    ``response`` on created / in_progress / the terminal one, ``item`` on output_item events)."""

    type: str
    sequence_number: int | None = None
    response: Response | None = None
    delta: str | None = None
    item: ResponseOutputItem | None = None
    item_id: str | None = None
    output_index: int | None = None
    content_index: int | None = None


class ResponseDeleted(_Open):
    id: str
    object: str = "response"
    deleted: bool = True


# --- Messages (``POST /v1/messages``) -------------------------------------------------------------


class MessageUsage(_Open):
    input_tokens: int | None = None
    output_tokens: int | None = None


class ContentBlock(_Open):
    """A content block: ``text`` (its ``text``), ``tool_use`` (``id``, ``name``, ``input``), ``thinking``…"""

    type: str | None = None
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    thinking: str | None = None


class Message(Timed):
    id: str | None = None
    type: str = "message"
    role: str | None = "assistant"
    model: str | None = None
    content: list[ContentBlock] = []
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessageUsage | None = None


class MessageStreamEvent(_Open):
    """One Messages stream event (``message_start``, ``content_block_delta``, ``message_stop``…);
    ``delta`` is as sent (a dict: ``text_delta``'s ``text``, ``message_delta``'s ``stop_reason``)."""

    type: str
    index: int | None = None
    message: Message | None = None
    content_block: ContentBlock | None = None
    delta: dict[str, Any] | None = None
    usage: MessageUsage | None = None


class MessageTokensCount(Timed):
    input_tokens: int


# --- Embeddings (``POST /v1/embeddings``) --------------------------------------------------------


class Embedding(_Open):
    """One input's vector: floats, or the server's base64 string when asked for base64."""

    object: str = "embedding"
    index: int = 0
    embedding: list[float] | str = []


class EmbeddingUsage(_Open):
    prompt_tokens: int | None = None
    total_tokens: int | None = None


class CreateEmbeddingResponse(Timed):
    """``POST /v1/embeddings``: OpenAI's response, with the server's timing as ``.timing``."""

    object: str = "list"
    data: list[Embedding] = []
    model: str | None = None
    usage: EmbeddingUsage | None = None
