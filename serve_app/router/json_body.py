"""Client JSON bodies, parsed strictly: the one parser behind every route that reads one.

Python's ``json`` accepts what other parsers, and this service's own sinks, do not: ``NaN`` and
``Infinity``; numbers past any engine's range (``1e400`` becomes ``inf``; an integer of 5,000
digits raises a bare ``ValueError``, a 500); duplicate keys (the last wins here, the first in other
parsers, so a proxy and the router could read two different requests); lone surrogates
(``"\\ud800"`` parses, then fails wherever the string is encoded as UTF-8); a UTF-8 BOM and UTF-16/32
bodies (detected and decoded). Each is a 400 ``invalid_json`` here, the message naming the problem
and ``param`` its path (``messages[0].content``). What passes is a dict that ``json.dumps(...,
allow_nan=False)`` encodes as UTF-8 and whose integers fit in 64 bits.

Cost: a typical body pays for a hook per object (a duplicate cannot be seen without one) and per
float (few in a request), plus a translate, a count and a regex search over the raw bytes. Those
say whether the checks that look at every value are needed at all (a run of 19 digits, more than
64 brackets, a ``\\uD800``-``\\uDFFF`` escape); most bodies need none of them. A refusal's path is
found by a walk of at most ``MAX_LOCATE_STEPS`` values, so a refusal stays cheap. Measured:
docs/api.md, "Bad input".
"""

import json
import math
import re
from itertools import count, islice, repeat
from typing import Any, Callable, Iterator

from serve_app.errors import APIError

# Deeper than any real request (a JSON schema for tools nests maybe 10 levels); a deeper body is
# refused before validation walks it, and far deeper ones (json's recursion limit) at parse time.
MAX_JSON_DEPTH = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Values the walk that finds an offender's path visits at most; past them the message names the
# problem without its path.
MAX_LOCATE_STEPS = 20_000
# The longest int64 has 19 digits, so a run of 19 is where an integer may stop fitting.
_DIGIT_RUN = b"9" * 19
# Digits mapped to 9, both opening brackets to [, every other byte to a space: a run of 19 digits
# and the bracket count are then a substring search and a count, not a regex over every byte.
_SHAPES = bytes(ord("9") if b in b"0123456789" else ord("[") if b in b"[{" else ord(" ") for b in range(256))
# A \u escape of a UTF-16 surrogate: the only way one can enter a string of strict UTF-8 text.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_UTF16_32_BOMS = (b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")
_UTF8_BOM = b"\xef\xbb\xbf"
# How much of a client's key or number an error message quotes.
_SHOWN_CHARS = 40


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or 400 ``invalid_json`` naming what is wrong and where."""
    text = _utf8_text(raw)
    shapes = raw.translate(_SHAPES)
    try:
        body = _loads(
            text, object_pairs_hook=_refusing_duplicates, parse_float=_finite, parse_constant=_refusing_constant
        )
    except (_Refused, ValueError):  # a duplicate key, NaN, 1e400; an integer of 4,301+ digits
        raise _refusal_of_marked(text) from None
    if not isinstance(body, dict):
        raise invalid_json("request body must be a JSON object")
    # Nesting past the limit takes more brackets than the limit: most bodies skip the walk.
    if shapes.count(b"[") > MAX_JSON_DEPTH and _depth_exceeds(body, MAX_JSON_DEPTH):
        raise _too_deep()
    if _DIGIT_RUN in shapes and not _integers_fit(body):
        raise _refusal(body, "an integer is out of range: integers must fit in 64 bits", scalar=_integer_problem)
    if _SURROGATE_ESCAPE.search(raw) is not None and not _all_unicode(body):
        raise _refusal(body, "a string or key holds a lone surrogate", scalar=_string_problem, key=_key_problem)
    return body


def invalid_json(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_json")


def _utf8_text(raw: bytes) -> str:
    """JSON between systems is UTF-8 without a BOM (RFC 8259 §8.1); ``json.loads(bytes)`` would
    guess UTF-16/32 and skip a BOM, and decodes with ``surrogatepass``."""
    if raw.startswith(_UTF8_BOM):
        raise invalid_json("request body starts with a UTF-8 byte order mark; send UTF-8 JSON without it")
    if raw.startswith(_UTF16_32_BOMS) or b"\x00" in raw[:4]:  # JSON text starts with ASCII
        raise invalid_json("request body looks like UTF-16 or UTF-32; JSON must be UTF-8")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise invalid_json(
            f"request body is not UTF-8: byte 0x{raw[err.start]:02x} at offset {err.start} ({err.reason})"
        ) from None


def _loads(text: str, **hooks: Any) -> Any:
    """``json.loads`` with its syntax and nesting errors as 400s; a hook's own exception passes."""
    try:
        return json.loads(text, **hooks)
    except RecursionError:  # the C parser stops at the interpreter's recursion limit, early
        raise _too_deep() from None
    except json.JSONDecodeError as err:  # in the second parse too: a hook may stop the first early
        raise invalid_json(f"request body is not valid JSON: {err}") from None


# --- the fast path's hooks: refuse, and let the second parse say where -------------------------
class _Refused(Exception):
    pass


def _refusing_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        raise _Refused
    return obj


def _refusing_constant(name: str) -> None:
    raise _Refused


def _finite(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise _Refused
    return value


# --- the second parse: offenders marked in place, then found with their path ---------------------
class _Offender:
    """Stands in the parsed tree where a value is refused, so one walk can name its path."""

    __slots__ = ("problem", "key")

    def __init__(self, problem: str, key: str | None = None):
        self.problem = problem
        self.key = key  # a duplicate: the key that repeats, inside the object this replaces


def _refusal_of_marked(text: str) -> APIError:
    """Parse again with hooks that mark instead of raising (integers only if json cannot convert
    one), and refuse the first offender."""
    marked: list[_Offender] = []

    def offender(problem: str, key: str | None = None) -> _Offender:
        marked.append(_Offender(problem, key))
        return marked[-1]

    def number(literal: str) -> float | _Offender:
        value = float(literal)
        return offender(f"number {_shown_number(literal)} is out of range for a double") if math.isinf(value) else value

    def constant(name: str) -> _Offender:
        return offender(f"{name} is not a JSON number; send a finite number or null")

    def integer(digits: str) -> int | _Offender:
        if len(digits) > 20:  # past int64 whatever the digits; and int() may refuse to convert it
            return offender(f"integer {_shown_number(digits)} is out of range: integers must fit in 64 bits")
        return int(digits)

    def obj(pairs: list[tuple[str, Any]]) -> dict[str, Any] | _Offender:
        built = dict(pairs)
        if len(built) == len(pairs):
            return built
        repeated = _first_repeated(key for key, _ in pairs)
        return offender(f"duplicate key {shown(repeated)!r}: a key may appear once per object", key=repeated)

    hooks = {"object_pairs_hook": obj, "parse_float": number, "parse_constant": constant}
    try:
        tree = _loads(text, **hooks)
    except ValueError:  # json could not convert an integer of 4,301+ digits
        marked.clear()
        tree = _loads(text, parse_int=integer, **hooks)
    return _refusal(tree, marked[0].problem if marked else "request body is not valid JSON")


def _first_repeated(keys: Iterator[str]) -> str:
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            return key
        seen.add(key)
    raise AssertionError("called only when a key repeats")


def _refusal(
    tree: Any,
    otherwise: str,
    scalar: Callable[[Any], str | None] | None = None,
    key: Callable[[str], str | None] | None = None,
) -> APIError:
    """400 naming the first offender (marked, or a scalar or key a check refuses) and its path, or
    ``otherwise`` when the walk finds none within ``MAX_LOCATE_STEPS``."""
    found = _first_offender(tree, scalar, key)
    if found is None:
        return invalid_json(f"request body refused: {otherwise}")
    path, problem = found
    return invalid_json(f"request body refused at {path or 'its top level'}: {problem}", path or None)


def _first_offender(
    tree: Any, scalar: Callable[[Any], str | None] | None, key_check: Callable[[str], str | None] | None
) -> tuple[str, str] | None:
    """``(path, problem)`` of the first offender in document order, or None. Iterative; children
    are queued at C speed with a link to their parent, and a path is spelled out only once found."""
    pending: list[tuple[Any, Any, str | int | None]] = [(tree, None, None)]  # (value, parent link, key or index)
    for _ in range(MAX_LOCATE_STEPS):
        if not pending:
            return None
        value, parent, part = pending.pop()
        link = parent if part is None else (parent, part)
        kind = type(value)
        if kind is _Offender:
            return _path(link if value.key is None else (link, value.key)), value.problem
        if kind is dict:
            if key_check is not None and key_check("\0".join(value)):  # NULs keep keys from pairing up
                for key in islice(value, MAX_LOCATE_STEPS):
                    if problem := key_check(key):
                        return _path((link, key)), problem
                return None
            # No more children than the walk could visit.
            pending.extend(reversed(list(islice(zip(value.values(), repeat(link), value.keys()), MAX_LOCATE_STEPS))))
        elif kind is list:
            pending.extend(reversed(list(islice(zip(value, repeat(link), count()), MAX_LOCATE_STEPS))))
        elif scalar is not None and (problem := scalar(value)):
            return _path(link), problem
    return None


def _path(link: Any) -> str:
    """``messages[0].content`` from a chain of ``(parent link, key or index)`` links."""
    parts: list[str | int] = []
    while link is not None:
        link, part = link
        parts.append(part)
    path = ""
    for part in reversed(parts):
        path += f"[{part}]" if isinstance(part, int) else f".{shown(part)}" if path else shown(part)
    return path


# --- what the checks refuse ------------------------------------------------------------------
def _integer_problem(value: Any) -> str | None:
    if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
        return f"integer {_shown_number(str(value))} is out of range: integers must fit in 64 bits"
    return None


def _string_problem(value: Any) -> str | None:
    return _lone_surrogate(value, "string") if type(value) is str else None


def _key_problem(key: str) -> str | None:
    return _lone_surrogate(key, "key")


def _lone_surrogate(text: str, what: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"the {what} holds a lone surrogate \\u{ord(text[err.start]):04x}; JSON text must be valid Unicode"
    return None


def shown(text: str) -> str:
    """A client's string fit to quote in an error body: short, and encodable (a lone surrogate in
    the message would fail the error response itself)."""
    cut = text[:_SHOWN_CHARS] + ("…" if len(text) > _SHOWN_CHARS else "")
    return cut.encode("utf-8", "backslashreplace").decode("utf-8")


def _shown_number(literal: str) -> str:
    return literal if len(literal) <= 24 else f"{literal[:12]}…({len(literal)} characters)"


def _too_deep() -> APIError:
    return invalid_json(f"request body nests deeper than {MAX_JSON_DEPTH} levels")


# --- whole-tree checks, iterative (a recursive walk is what the depth limit protects against) ---
def _depth_exceeds(value: Any, limit: int) -> bool:
    """Visits containers only, level by level."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        level = [
            child
            for container in level
            for child in (container.values() if isinstance(container, dict) else container)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


def _integers_fit(body: dict[str, Any]) -> bool:
    """Every integer in int64 (``type(True)`` is bool: booleans are not integers here)."""
    pending: list[Any] = [body]
    while pending:
        values = list(container.values()) if isinstance(container := pending.pop(), dict) else container
        integers = [value for value in values if type(value) is int]
        if integers and (min(integers) < INT64_MIN or max(integers) > INT64_MAX):
            return False
        pending += [value for value in values if isinstance(value, (dict, list))]
    return True


def _all_unicode(body: dict[str, Any]) -> bool:
    """No lone surrogate in any string or key: the encoder at C speed, not a walk."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
