"""The items of one handle call between the router and a model replica.

The router calls the replica method of a surface with a ``Call``. The replica yields, in order:

- a request that answers with one body (any non-stream surface that generates nothing, or any
  error found before work starts): one ``Answer``, its ``trailer`` inside;
- a stream: ``StreamOpen`` (connect to this socket, present this ticket: the SSE bytes come
  there, as the engine produces them), then the ``Trailer`` once the engine is done;
- a non-stream request that generates: ``Accepted`` at once (the same socket, which carries no
  bytes: closing it is the router's hang-up, after which the engine stops and the tokens
  generated so far are still reported), then its ``Answer`` when the engine is done.

Tokens never cross the handle: it carries control (Serve's routing, admission, queueing,
autoscaling and drain all count the call as one ongoing request for its whole life). These are
plain dataclasses so that Serve pickles them as it pickled dicts, and both processes import this
module without Ray or vLLM.

**A rolling upgrade runs old and new code side by side**: a router of one version calls replicas
of the other for as long as Serve replaces them. A message pickles as its field values in
order (the dataclass's own state, compact), so the rule is that of a positional protocol: a new
field goes **last, with a default**, and no field is removed, renamed or moved
(``tests/unit/test_wire_messages.py`` holds each message's released fields and fails otherwise);
its values are builtins or classes released before it (pickle must find a value's class before
the reader can drop the field: a new message class goes out, unused, one release ahead). Then an
older reader drops the fields it does not know (they come last), and a newer reader gives the
fields an older writer did not send their defaults (``_versioned``): before, such a field was
left unset, and reading it raised (an older router's resume read by a newer replica).
"""

from dataclasses import MISSING, dataclass, field, fields
from typing import Any


def _versioned(cls):
    """``cls`` (a frozen slots dataclass) read from the state of any version: the values it
    carries, in field order, and the defaults of the fields it lacks."""
    layout = tuple(fields(cls))

    def __setstate__(self, state) -> None:
        for spec, value in zip(layout, state):
            object.__setattr__(self, spec.name, value)
        for spec in layout[len(state):]:
            if spec.default is not MISSING:
                object.__setattr__(self, spec.name, spec.default)
            elif spec.default_factory is not MISSING:
                object.__setattr__(self, spec.name, spec.default_factory())
            else:  # a field released without a default: the writer cannot have omitted it
                raise TypeError(f"{cls.__name__} state lacks its field {spec.name!r}")

    cls.__setstate__ = __setstate__
    return cls

Body = dict[str, Any]
Address = tuple[str, int]


@_versioned
@dataclass(frozen=True, slots=True)
class Resume:
    """Where a stream whose engine failed continues from: what its client already has."""

    token_ids: tuple[int, ...]  # the tokens generated so far, in order: the new prompt's tail
    # What the client has of the answer, per channel (``surfaces/seam.py``): the continuation
    # replays the tokens and sends only the rest — nothing twice, nothing lost.
    received: dict[str, int] = field(default_factory=dict)
    ids: dict[str, str] = field(default_factory=dict)  # Responses: the client's output item ids
    # The first call's prompt tokens served from the prefix cache: the continuation's usage says
    # what the uninterrupted stream's would have (its own prefill, the prompt and the tail, is the
    # engine's business, recorded apart). None: no call counted the prompt yet (the engine died
    # before its first output), so the continuation's own count stands.
    cached_tokens: int | None = None
    # Chat and completions: the ``created`` of the chunks the client has. vLLM stamps each stream
    # when its generator starts: the continuation's chunks say the first call's, as one stream's do.
    created: int | None = None


@_versioned
@dataclass(frozen=True, slots=True)
class Call:
    """One request of one surface, as the router sends it to a replica."""

    body: Body  # validated and normalised by the router; the engine's own model checks it again
    request_id: str  # the router's id for the request: the engine request's, and the usage record's
    # The completion limit in ``body`` is the router's default, not the client's: where the real
    # prompt leaves less room, the engine clamps it instead of refusing the request.
    limit_set_by_router: bool = False
    # Responses: the id the client continued from; the router has replaced it by the stored
    # conversation, and the answer echoes it.
    previous_response_id: str | None = None
    # The prefix-cache partition of the caller's owner (vLLM's ``cache_salt``): one tenant can
    # never hit, and so never time, another tenant's cached prompt.
    cache_salt: str | None = None
    # A stream resumed on this replica after its engine failed elsewhere: the engine continues
    # the rendered prompt plus these tokens, and the stream starts where the client's stopped.
    resume: Resume | None = None
    # The conversation the caller says this request continues (``routing.session_key``: the
    # x-session-id header, prompt_cache_key, previous_response_id, metadata.user_id or user, in
    # that order): the model deployment's request router keeps it on one replica.
    session: str | None = None
    # The replica (Serve's replica id) whose engine failed this stream: its continuation goes to
    # another while Serve still routes to it (a dead engine fails its health checks for ~10 s).
    avoid_replica: str | None = None
    # The router takes an ``Answer`` whose body comes as JSON text (``Answer.encoded``); a router
    # released before does not, and is answered with the dict.
    encoded_answers: bool = False

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True


@_versioned
@dataclass(frozen=True, slots=True)
class Generated:
    """The tokens the engine handled for a request, counted as they passed (the bill of a request
    whose answer never finished)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@_versioned
@dataclass(frozen=True, slots=True)
class EngineTiming:
    """vLLM's per-request durations (differences of engine-core monotonic timestamps)."""

    queue_ms: float | None = None  # queued → first scheduled
    prefill_ms: float | None = None  # first scheduled → first token
    decode_ms: float | None = None  # first token → last token


@_versioned
@dataclass(frozen=True, slots=True)
class Trailer:
    """What the replica reports once the engine is done with a request."""

    timing: EngineTiming = EngineTiming()
    usage: Body | None = None  # the engine's usage (prompt_tokens, completion_tokens, …) when it finished
    finish_reasons: tuple[str, ...] = ()
    complete: bool = True  # False: the stream broke off before the engine finished
    error_code: str | None = None  # why it broke off, or the code of the error event it ended with
    error_status: int | None = None  # the status of that error event (the status line said 200)
    replica: str | None = None  # the model replica (Serve replica tag)
    generated: Generated = Generated()
    # Responses: the final response object, which the router stores for previous_response_id.
    response: Body | None = None
    # Responses and Messages: the stream's terminal event, held back by the replica so that the
    # router can complete it with the request's timing and send it last (the protocols' rule).
    terminal: Body | None = None
    # A stream cut short (``complete`` False) with one choice: the tokens its engine generated,
    # in order, so that another replica can resume it from exactly there.
    token_ids: tuple[int, ...] | None = None
    # A stream the router handed over (``wire/handoff.py``) and cut short: the bytes the replica
    # wrote to the client, when the router asked it to keep them (a resume starts after them).
    written: bytes | None = None
    # A handed-over stream's client left (its connection failed) or read nothing for the stall
    # time: the request was abandoned, not failed.
    client_gone: bool = False


@_versioned
@dataclass(frozen=True, slots=True)
class Answer:
    """A whole response: a non-stream body, or any error the replica reports before a stream."""

    status: int
    body: Body
    trailer: Trailer | None = None  # a success's engine report (None: an error before the engine)
    replica_ms: float | None = None  # the replica's own time before this item (not Serve's queue)
    # The whole body as the JSON the client gets (``body`` then empty), for a call that allowed it
    # (``Call.encoded_answers``): embeddings, whose vectors vLLM encoded already (tens of MB that
    # the router decoded and encoded again on the event loop every stream shares).
    encoded: bytes | None = None


@_versioned
@dataclass(frozen=True, slots=True)
class StreamOpen:
    """A stream: its SSE bytes come on ``address`` to whoever presents ``ticket`` (over TLS when
    ``tls``: the region's option, ``wire/tls.py``)."""

    address: Address
    ticket: str
    replica_ms: float | None = None
    tls: bool = False
    # The replica's Unix listener and Ray node: a router on the same node connects there instead,
    # and may hand its client's connection over (``wire/handoff.py``).
    local: str | None = None
    node: str | None = None
    line: "DirectLine | None" = None  # where this replica also takes calls without the handle


@_versioned
@dataclass(frozen=True, slots=True)
class Accepted:
    """A non-stream request is under way; hang up on ``address`` (after presenting ``ticket``)
    to stop it. Its ``Answer`` follows."""

    address: Address
    ticket: str
    replica_ms: float | None = None
    tls: bool = False
    # The replica's Unix listener and Ray node: a router on the same node connects there instead,
    # and may hand its client's connection over (``wire/handoff.py``).
    local: str | None = None
    node: str | None = None
    line: "DirectLine | None" = None  # where this replica also takes calls without the handle


@_versioned
@dataclass(frozen=True, slots=True)
class DirectLine:
    """A replica's direct line (``wire/line.py``): its listener takes calls there from whoever
    presents ``key``, which only its heads carry (they cross Serve's handle, inside the Ray
    cluster's trust boundary). A router whose region sets ``handle_transport: direct`` learns
    the line from a head and sends later calls on it, without the handle."""

    replica: str  # Serve's replica id
    key: str = field(repr=False)  # 32 hex characters, this replica's for its life: never logged
    address: Address
    tls: bool = False
    local: str | None = None  # its Unix listener, for a router on its node
    node: str | None = None
    capacity: int = 1  # calls in flight it takes at most (its max_ongoing_requests)


@_versioned
@dataclass(frozen=True, slots=True)
class Refused:
    """A direct line's answer to a call it does not take: the replica is full or stopping. The
    router sends the call through Serve's handle instead (nothing has started)."""

    reason: str  # "full" or "stopping"


Head = Answer | StreamOpen | Accepted
# What an abandoned request's wait may end with: its last item, however it came.
Last = Answer | Trailer


# The error code of a replica whose engine died (a 503 before a stream, or a stream's last error
# event): the router may send the request to another replica or region.
ENGINE_UNAVAILABLE = "engine_unavailable"
