"""The region's media policy at the router: which content parts a request may carry.

A multimodal checkpoint fetches the URL of every image, audio or video part it is given, from
the model replica, inside the cluster. So the router reads every content part before a request
is charged or sent, against the model's ``MediaPolicy`` (``serve_app.config``):

- media off (the default): only text parts pass; any other part is a 400 ``media_not_allowed``
  naming it (``messages[0].content[1]``);
- an allow-list: a URL must be ``http(s)://`` on exactly one of the allowed hosts (parsed with
  urllib3, as vLLM parses it before its own check, so the two cannot disagree), without
  userinfo; media inline as a base64 ``data:`` URL (or ``input_audio`` data) passes, since it
  fetches nothing. Anthropic ``document`` blocks are refused either way: vLLM drops them
  without a word, and a request should not be answered as if they had been read.

What counts as text is vLLM's own rule for chat content (``has_non_text_content`` in
``vllm.renderers.chat_utils``: a text type and none of the media keys, whatever the type says),
which ``tests/unit/test_media_policy.py`` holds this module to; Responses input is rendered into
chat content by vLLM, so the same rule applies to its parts. The engine gets the same list
(``--allowed-media-domains``) and follows no redirect: this check is the clear 400, the engine's
the backstop for history the router did not see (a stored conversation's earlier turns).

Nothing here imports vLLM.
"""

from collections.abc import Iterator
from typing import Any

from urllib3.exceptions import LocationParseError
from urllib3.util import parse_url

from serve_app.config import MediaPolicy
from serve_app.errors import APIError

MEDIA_NOT_ALLOWED = "media_not_allowed"

# vLLM's TEXT_PART_TYPES, and tool_reference (no media either).
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"})
# vLLM's _MEDIA_CONTENT_PART_KEYS: a part with any of these keys is media, whatever its type.
MEDIA_PART_KEYS = frozenset({
    "image_url", "input_image", "image_pil", "image_embeds", "audio_url", "input_audio", "audio_embeds",
    "video_url", "video_embeds", "prompt_embeds",
})
# The keys whose value is a URL vLLM fetches (a string, or {"url": ...}); input_image's is image_url.
_URL_KEYS = ("image_url", "audio_url", "video_url", "file_url")
# Responses input items whose ``output`` is content parts (a tool's result, images included).
_OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output")
_ANTHROPIC_MEDIA_BLOCKS = ("image", "document")

Part = tuple[str, Any]  # the part's path as ``param`` spells it, and the part


def media_problem(method: str, body: dict[str, Any], policy: MediaPolicy) -> APIError | None:
    """The 400 for the first content part of ``body`` (a validated body of replica method
    ``method``) that ``policy`` refuses, or None."""
    if method in ("messages", "count_tokens"):
        return _first(_anthropic_problem(path, block, policy) for path, block in _anthropic_blocks(body))
    parts = _responses_parts(body) if method == "responses" else _chat_parts(body.get("messages"))
    return _first(_openai_problem(path, part, policy) for path, part in parts)


def is_text_part(part: Any) -> bool:
    """vLLM's rule: a plain string, or a dict with a text type (``text`` when absent) and no
    media key."""
    if not isinstance(part, dict):
        return isinstance(part, str)
    kind = part.get("type", "text")
    return isinstance(kind, str) and kind in TEXT_PART_TYPES and not MEDIA_PART_KEYS.intersection(part)


# --- where the parts are -----------------------------------------------------------------------


def _chat_parts(messages: Any, prefix: str = "messages") -> Iterator[Part]:
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        if isinstance(message, dict):
            yield from _listed(message.get("content"), f"{prefix}[{i}].content")


def _responses_parts(body: dict[str, Any]) -> Iterator[Part]:
    items = body.get("input")
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if not isinstance(item, dict):
            continue
        if (item.get("type") or "message") == "message":  # a reasoning item's content is its own
            yield from _listed(item.get("content"), f"input[{i}].content")
        elif item.get("type") in _OUTPUT_ITEMS:
            yield from _listed(item.get("output"), f"input[{i}].output")


def _anthropic_blocks(body: dict[str, Any]) -> Iterator[Part]:
    for path, block in _chat_parts(body.get("messages")):
        yield path, block
        if isinstance(block, dict) and block.get("type") == "tool_result":
            yield from _listed(block.get("content"), f"{path}.content")


def _listed(content: Any, path: str) -> Iterator[Part]:
    if isinstance(content, list):
        for j, part in enumerate(content):
            yield f"{path}[{j}]", part


def _first(problems: Iterator[APIError | None]) -> APIError | None:
    return next((problem for problem in problems if problem is not None), None)


# --- what each part may be ---------------------------------------------------------------------


def _openai_problem(path: str, part: Any, policy: MediaPolicy) -> APIError | None:
    if is_text_part(part):
        return None
    if not policy.enabled:
        return _off(path, part)
    for key in _URL_KEYS:
        value = part.get(key)
        url = value.get("url") if isinstance(value, dict) else value
        if isinstance(url, str) and (problem := _url_problem(url, policy)):
            return _refused(f"{path}.{key}", problem)
    if "uuid" in part:
        # vLLM keys its media caches (the processor's and the encoder's) by a part's uuid, with no
        # cache salt, across every owner of a replica: a part naming a uuid, with or without data,
        # could be served another owner's image or plant its own under their uuid.
        return _refused(f"{path}.uuid", "uuid is not supported: media parts are identified by their content")
    return None


def _anthropic_problem(path: str, block: Any, policy: MediaPolicy) -> APIError | None:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in _ANTHROPIC_MEDIA_BLOCKS:
        return None  # text, tool use and results, thinking: vLLM renders them as text
    if not policy.enabled:
        return _off(path, block)
    if kind == "document":
        return _refused(path, "document blocks are not supported: the model reads text and images only")
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(url := source.get("url"), str):
        if problem := _url_problem(url, policy):
            return _refused(f"{path}.source.url", problem)
    return None


def _url_problem(url: str, policy: MediaPolicy) -> str | None:
    """Why ``url`` may not be fetched under ``policy`` (allow-list on), or None."""
    if url[:5].lower() == "data:":
        return None  # inline: nothing is fetched
    try:
        parsed = parse_url(url)
    except LocationParseError:
        return "the media URL cannot be parsed"
    if parsed.scheme not in ("http", "https"):
        return "a media URL must be https:// (or http://) on an allowed host, or a base64 data: URL"
    if parsed.auth is not None:
        return "a media URL may not carry a user name or password"
    if parsed.hostname not in policy.allowed_domains:
        return (
            f"media URLs may name these hosts only: {', '.join(policy.allowed_domains)} "
            f"(not {parsed.hostname!r})"
        )
    return None


def _off(path: str, part: Any) -> APIError:
    kind = part.get("type") if isinstance(part, dict) else None
    what = f"a {kind!r} part" if isinstance(kind, str) else "a part that is not text"
    return _refused(path, f"{what}: this model takes text only here (media input is off)")


def _refused(path: str, reason: str) -> APIError:
    return APIError(400, f"{path}: {reason}", param=path, code=MEDIA_NOT_ALLOWED)
