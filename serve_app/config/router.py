"""The router's own settings, and those of what runs in it: stored Responses, the usage ledger's
writer, failover to peer regions."""

from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from serve_app.config.model import REQUEST_TIMEOUT_S
from serve_app.settings import Settings

# How long a router replica being replaced may take to stop. Behind HAProxy Serve keeps it
# reachable for 30 s first (RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S: a stale HAProxy process
# may still send it requests), and a request it admits then may run the whole request timeout;
# then what its settling waits for, the longest being a Responses answer's store (router/context.py
# STORE_WAIT_S, 30 s; a stream's last item router/call.py LAST_ITEM_WAIT_S, 10 s), and the ledger's
# last write (usage/ledger.py CLOSE_WRITE_S, 15 s, then the spool for what the database did not
# take), and 5 s to spare. At the request timeout alone (600 s, until 2026-12-07) Serve killed the
# replica while such a request ran: its record, and every record the ledger had not written yet,
# were lost, and their tokens never billed (660 s that day still left out the store's wait).
ROUTER_DRAIN_S = REQUEST_TIMEOUT_S + 30 + 30 + 15 + 5


class RouterArgs(Settings):
    num_replicas: int = Field(1, ge=1)
    # A stream's client that reads nothing for this long (its socket open: a half-open client) is
    # cut, and its engine request stopped and billed what it generated (router/client_socket.py).
    stall_timeout_s: float = Field(30, gt=0, le=600)
    # On: a stream served by a model replica on the router's node is written by the replica
    # straight to the client's connection, which the router hands it (wire/handoff.py): no router
    # process touches its tokens. Off (the default): the router relays them. Measured on the 2-core
    # host the hand-off moves the per-token socket cost from the router to the replica and gains no
    # throughput (docs/benchmarks.md, "The hand-off"); it pays where routers are short of CPU.
    hand_off_streams: bool = False
    # How a request reaches its model replica. "direct" (the default): for a model with one running
    # replica and none stopping, on that replica's own direct line, a connection to its byte
    # listener that the router keeps open (wire/line.py, router/lines.py), once a head has named
    # it; through Serve's handle over gRPC otherwise — two replicas or more (Serve's request router
    # places each call by prefix affinity and session), a resumed stream, and any call the line
    # does not take (a full or stopping replica). Measured on the 2-core host it takes ~3 ms (the handle call's cost) off a stream's
    # TTFT at one stream (docs/benchmarks.md, "The direct line"); what it gives up and how each is
    # kept: docs/architecture.md.
    # "grpc": every call through the handle, by Serve's by-value transport (a gRPC call to the
    # replica's inter-deployment server, ``_by_reference=False``); "actor": as a Ray actor task,
    # whose items pass through both processes' core workers (gRPC is ~1.7 ms faster at one
    # stream, "The handle's transport"). Both keep Serve's routing, admission
    # (max_ongoing_requests), metrics and cancellation for every call.
    handle_transport: Literal["direct", "grpc", "actor"] = "direct"
    # A stream whose engine fails mid-answer is resumed on another replica of the region this
    # many times at most, each within resume_window_s of the failure (router/resume.py). The
    # region's replicas are tried for resume_here_s (longer than a model's health check period,
    # so that Serve has stopped routing to the dead one), then a peer region's.
    max_resumes: int = Field(1, ge=0, le=3)
    resume_window_s: float = Field(30, gt=0, le=300)
    resume_here_s: float = Field(5, gt=0, le=300)
    # The router does little CPU work; a whole CPU would starve the model replica on small hosts
    # (on a 2-CPU machine Ray could never place both).
    num_cpus: float = Field(0.1, ge=0)
    # Ray custom resources each router replica asks for besides its CPUs: a region's routers ask
    # for the one only its head offers (serve_app/regions/serve_config.py ROUTER_NODE_RESOURCE), so
    # they run where the region's credentials are and never on a model's GPU pod, which holds none.
    resources: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    max_ongoing_requests: int = Field(1000, ge=1)
    # A router replica being replaced relays its streams to their end first (docs/operations.md).
    graceful_shutdown_timeout_s: float = Field(ROUTER_DRAIN_S, ge=0)


# One stored response with its conversation, as JSON, at most (a bigger one is answered, not stored).
MAX_STORED_RESPONSE_BYTES = 4 * 1024 * 1024


class ResponsesArgs(Settings):
    """The Responses API's stored objects (``store: true``, ``previous_response_id``), kept in the
    key registry's database with the keys and the ledger, so every router of every region sees
    the same rows (serve_app/router/response_store.py; docs/api.md, "Responses").

    Per owner, a quota its own puts keep: an owner past it loses its own oldest responses. The
    defaults fit a busy agent's month: 10,000 responses is 330 a day for the 30-day retention,
    and 256 MiB averages 26 KiB a row (a conversation at the 8192-token context is ~32 KiB of
    text, so a row at the cap is 40-70 KiB with its output). ``max_responses`` bounds the whole
    registry's table: past it, the owners holding the most lose their oldest first."""

    retention_hours: float = Field(720, gt=0, description="Stored responses expire after this (OpenAI keeps 30 days).")
    max_responses: int = Field(
        100_000, ge=1, description="Across every owner and region; past it the owners holding the most lose their oldest."
    )
    max_responses_per_owner: int = Field(10_000, ge=1, description="An owner past this loses its own oldest.")
    max_mib_per_owner: float = Field(
        256,
        ge=MAX_STORED_RESPONSE_BYTES / 2**20,  # one response must always fit
        description="Stored JSON (responses and their conversations) per owner; past it the owner loses its own oldest.",
    )

    @model_validator(mode="after")
    def _owner_within_total(self) -> "ResponsesArgs":
        if self.max_responses_per_owner > self.max_responses:
            raise ValueError(
                f"max_responses_per_owner ({self.max_responses_per_owner}) exceeds max_responses ({self.max_responses})"
            )
        return self


class UsageArgs(Settings):
    """The usage ledger's writer on each router replica (serve_app/usage/, docs/usage.md)."""

    spool_dir: str | None = Field(
        None,
        description="Where records wait while the registry database is unreachable (absolute path, "
        "on a volume every router replica of the region reaches); default: usage-spool/ beside the "
        "key store file (auth.key_store_path).",
    )
    flush_interval_s: float = Field(1.0, gt=0, le=60, description="Records are written in batches this often.")

    @field_validator("spool_dir")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_absolute():
            raise ValueError(f"must be an absolute path, got {value!r}")
        return value


_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class Peer(Settings):
    region: str = Field(description="The peer region's id.")
    endpoint: str = Field(description="Base URL of its router: https://..., or http:// on loopback.")

    @field_validator("endpoint")
    @classmethod
    def _https(cls, value: str) -> str:
        url = urlsplit(value)
        # Forwarded requests carry the caller's credential: plaintext only never leaves the host.
        if url.scheme == "https" or (url.scheme == "http" and url.hostname in _LOOPBACK_HOSTS):
            if url.hostname:
                return value.rstrip("/")
        raise ValueError(f"{value!r}: a peer endpoint must be https:// (http:// only on 127.0.0.1)")


class FailoverArgs(Settings):
    """Cross-region failover (serve_app/router/failover.py): one hop to a peer region's router."""

    peers: list[Peer] = Field(default_factory=list, description="Most preferred first.")
    max_attempts: int = Field(2, ge=1, description="Peers tried per request before giving up.")
    connect_timeout_s: float = Field(2, gt=0, description="Per peer: a dead peer costs this much.")
    unreachable_hold_s: float = Field(10, ge=0, description="Skip a peer this long after it was unreachable.")
    # Between bytes of the peer's answer; a non-streamed completion sends nothing until it is done.
    read_timeout_s: float = Field(600, gt=0)
