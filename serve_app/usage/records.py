"""One admitted inference request, as the usage ledger keeps it.

The router makes the record's ``id`` when the request arrives, so every copy of a record (in
memory, in a spool file, replayed by another replica) carries the same id and the database counts
it once however often it is written.
"""

import dataclasses
import datetime as dt
import types
import typing
from dataclasses import dataclass
from typing import Any


def utc_day(epoch_s: float) -> str:
    """The UTC day ``YYYY-MM-DD`` an epoch time falls on: the unit of rollups and budgets."""
    return dt.datetime.fromtimestamp(epoch_s, dt.timezone.utc).strftime("%Y-%m-%d")


class UnknownFields(ValueError):
    """A record with fields this release does not know: a newer release wrote it (a spool file
    it left during a rolling deploy or a rollback), which can replay it."""


@dataclass(frozen=True)
class UsageRecord:
    id: str  # idempotent record id (uuid4 hex), made by the router when the request arrives
    key_id: str
    owner: str
    region: str  # the region that served it
    model: str
    route: str  # e.g. "/v1/chat/completions"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    status: int  # HTTP status as recorded (200, 499 client closed, 503, ...)
    finish_reason: str | None
    started_at_ms: int  # epoch milliseconds
    ended_at_ms: int
    failover_origin: str | None = None  # the region that forwarded this request here, if any
    # Bytes this request stored (a Responses object with its conversation): what it added to the
    # owner's stored data, counted like its tokens. Records written before the field carry 0.
    stored_bytes: int = 0
    # A stream resumed on another replica after its engine failed: how many times, and the
    # prompt tokens those continuations prefilled (the prompt again plus what was generated before
    # each seam) — engine work, not the customer's prompt, so apart from prompt_tokens.
    resumes: int = 0
    resume_prompt_tokens: int = 0
    resumed_in: str | None = None  # the peer region whose replica continued the stream, if one did
    # Not a request: what a peer region's engine did for a stream another region admitted and
    # records (that record's id here). The peer's tokens count in budgets and reports; the
    # request, once, in its own record (``serve_app/router/resume.py``).
    continues: str | None = None

    @property
    def day(self) -> str:
        """The UTC day the request started on: a request running across midnight counts once,
        on the day it was admitted (the day whose budget admitted it)."""
        return utc_day(self.started_at_ms / 1000)

    @property
    def total_tokens(self) -> int:
        # Cached prompt tokens are part of prompt_tokens already (OpenAI's usage shape).
        return self.prompt_tokens + self.completion_tokens

    def to_json(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        if raw["continues"] is None:  # a spool a release before the field can replay (rolled back)
            del raw["continues"]
        return raw

    @classmethod
    def from_json(cls, raw: Any) -> "UsageRecord":
        """A record from ``to_json``'s dict. Strict (ValueError on a missing, unknown or mistyped
        field): a spool line that PostgreSQL would refuse must be caught here, or it would fail
        the whole replayed file every time."""
        if not isinstance(raw, dict):
            raise ValueError(f"a usage record is a JSON object, not {type(raw).__name__}")
        unknown = set(raw) - set(_TYPES)
        if unknown:
            raise UnknownFields(f"unknown fields {sorted(unknown)}")
        for name, allowed in _TYPES.items():
            if name not in raw:
                if name in _OPTIONAL:
                    continue
                raise ValueError(f"missing field {name!r}")
            value = raw[name]
            # bool is an int to isinstance; a record never has one.
            if isinstance(value, bool) or not isinstance(value, allowed):
                raise ValueError(f"field {name!r} has the wrong type ({type(value).__name__})")
            # What no request has, or the database cannot take: a time past year 9999 (the record's
            # day), a count or status past 2^31 (summed by the day's rollup, it could overflow a
            # BIGINT), anything negative; and PostgreSQL's text takes neither a NUL nor a lone surrogate.
            if isinstance(value, int) and not 0 <= value <= (_MAX_MS if name.endswith("_ms") else _MAX_COUNT):
                raise ValueError(f"field {name!r} is out of range ({value})")
            if isinstance(value, str) and ("\x00" in value or not _utf8(value)):
                raise ValueError(f"field {name!r} is not text the database can store")
        return cls(**raw)


_MAX_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z
_MAX_COUNT = 2**31 - 1


def _utf8(value: str) -> bool:
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _allowed_types(annotation: Any) -> tuple[type, ...]:
    if isinstance(annotation, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


_HINTS = typing.get_type_hints(UsageRecord)
_TYPES = {f.name: _allowed_types(_HINTS[f.name]) for f in dataclasses.fields(UsageRecord)}
_OPTIONAL = {f.name for f in dataclasses.fields(UsageRecord) if f.default is not dataclasses.MISSING}
COLUMNS = tuple(_TYPES)
