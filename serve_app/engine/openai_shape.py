"""Non-stream chat and completions bodies as the OpenAI schema has them, from vLLM's ``model_dump()``.

vLLM dumps every field of its response models, so a plain answer carries ``null`` where the
OpenAI spec says "object, array or enum, or absent" (``message.annotations``, ``function_call``,
``service_tier``, ``usage.prompt_tokens_details``…), and vLLM's own extras (``token_ids``,
``stop_reason``, ``prompt_logprobs``, ``kv_transfer_params``…) that nobody asked for. Schema
validators (and strict SDKs) reject the first; the second is noise. Here, once per non-stream
body in the replica (a walk over a few dozen keys, no JSON encode):

- a ``None`` is dropped unless the spec makes the field *required and nullable* (chat:
  ``choices[].logprobs``, ``message.content``, ``message.refusal``; completions:
  ``choices[].logprobs``), which must stay present as ``null``;
- a vLLM-only field is kept only when the request asked for it (``return_token_ids`` →
  ``token_ids``/``prompt_token_ids``; ``prompt_logprobs``; ``return_prompt_text``;
  ``kv_transfer_params``; ``stop``/``stop_token_ids`` → ``stop_reason``, the one that matched);
- a chat ``logprobs`` object gets the ``refusal: null`` the spec requires next to ``content``.

Per-token entries inside ``logprobs`` are left as vLLM builds them: the spec requires their
``bytes`` even when ``null``, and walking them would cost per token. Stream chunks are not touched
here (docs/api.md, "Schema-exact bodies", says what vLLM's chunks still carry).
"""

from typing import Any

Body = dict[str, Any]

# Required by the spec and allowed to be null: present as null rather than absent.
_CHAT_CHOICE_NULLABLE = frozenset({"logprobs", "finish_reason"})
_CHAT_MESSAGE_NULLABLE = frozenset({"content", "refusal"})
_COMPLETION_CHOICE_NULLABLE = frozenset({"logprobs", "finish_reason"})


def _asked(request: Body) -> dict[str, bool]:
    """Which vLLM-only response fields this request asked for."""
    token_ids = bool(request.get("return_token_ids"))
    return {
        "token_ids": token_ids,
        "prompt_token_ids": token_ids,
        "prompt_logprobs": request.get("prompt_logprobs") is not None,
        "prompt_text": bool(request.get("return_prompt_text")),
        "kv_transfer_params": request.get("kv_transfer_params") is not None,
        "ec_transfer_params": request.get("ec_transfer_params") is not None,
        # vLLM's stop_reason is the stop string or token id that ended the choice. Without a
        # `stop` of the caller's it could only name one of the model's own end-of-turn ids.
        "stop_reason": bool(request.get("stop")) or bool(request.get("stop_token_ids")),
        # Set only when the operator enables --enable-return-routed-experts.
        "routed_experts": True,
    }


# vLLM extras per level; a key here is dropped unless the request asked for it.
_CHAT_TOP_EXTRAS = ("prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params")
_CHAT_CHOICE_EXTRAS = ("stop_reason", "token_ids", "routed_experts")
_COMPLETION_TOP_EXTRAS = ("kv_transfer_params", "ec_transfer_params")
_COMPLETION_CHOICE_EXTRAS = ("stop_reason", "token_ids", "prompt_logprobs", "prompt_token_ids", "routed_experts")


def _prune(obj: Body, extras: tuple[str, ...], asked: dict[str, bool], nullable: frozenset[str] = frozenset()) -> None:
    for key in extras:
        if key in obj and not asked.get(key, False):
            del obj[key]
    for key in [key for key, value in obj.items() if value is None and key not in nullable]:
        del obj[key]


def _usage(body: Body) -> None:
    usage = body.get("usage")
    if not isinstance(usage, dict):
        return
    for name in ("prompt_tokens_details", "completion_tokens_details"):
        details = usage.get(name)
        if isinstance(details, dict):
            _prune(details, (), {})
    _prune(usage, (), {})


def chat(body: Body, request: Body) -> Body:
    """A ``chat.completion`` body made schema-exact, in place (and returned)."""
    for choice in _shape(body, request, _CHAT_TOP_EXTRAS, _CHAT_CHOICE_EXTRAS, _CHAT_CHOICE_NULLABLE):
        if isinstance(message := choice.get("message"), dict):
            # `reasoning` (vLLM's, present when thinking is on) is dropped only when null.
            _prune(message, (), {}, _CHAT_MESSAGE_NULLABLE)
            for key in _CHAT_MESSAGE_NULLABLE:
                message.setdefault(key, None)
        if isinstance(logprobs := choice.get("logprobs"), dict):
            logprobs.setdefault("content", None)
            logprobs.setdefault("refusal", None)
    return body


def completion(body: Body, request: Body) -> Body:
    """A ``text_completion`` body made schema-exact, in place (and returned)."""
    _shape(body, request, _COMPLETION_TOP_EXTRAS, _COMPLETION_CHOICE_EXTRAS, _COMPLETION_CHOICE_NULLABLE)
    return body


def _shape(
    body: Body, request: Body, top_extras: tuple[str, ...], choice_extras: tuple[str, ...], choice_nullable: frozenset[str]
) -> list[Body]:
    """The levels chat and completions share (top, usage, each choice); returns the choices."""
    asked = _asked(request)
    _prune(body, top_extras, asked)
    _usage(body)
    choices = [choice for choice in body.get("choices") or () if isinstance(choice, dict)]
    for choice in choices:
        _prune(choice, choice_extras, asked, choice_nullable)
    return choices


def without_nulls(body: Body, request: Body | None = None) -> Body:
    """Top-level ``null`` fields dropped (tokenize's ``token_strs`` when not asked for). Takes
    the request like the other shapes, which ``VLLMEngine._run`` passes to each."""
    _prune(body, (), {})
    return body


# OpenAI's CreateEmbeddingResponse and Embedding: exactly these fields (vLLM adds an id, a
# created time and, in usage, completion tokens and null details).
_EMBEDDING_FIELDS = ("object", "index", "embedding")


def embeddings(body: Body, request: Body | None = None) -> Body:
    """A vLLM embeddings body as OpenAI sends it: ``object``, ``data``, ``model``, ``usage`` with
    ``prompt_tokens`` and ``total_tokens``."""
    data = [{key: item[key] for key in _EMBEDDING_FIELDS} for item in body.get("data") or ()]
    usage = embeddings_usage(body.get("usage"))
    body.clear()
    body.update(object="list", data=data, model=(request or {}).get("model"), usage=usage)
    return body


def embeddings_usage(usage: Body | None) -> Body:
    """vLLM's embeddings usage as OpenAI's: the prompt tokens, and the same as the total."""
    prompt = int((usage or {}).get("prompt_tokens") or 0)
    return {"prompt_tokens": prompt, "total_tokens": prompt}
