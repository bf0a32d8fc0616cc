"""What a router replica serves with, built once when it starts: who is calling (``auth``), what
they spent (``meter``), where each model stands (``states``, ``in_flight``), stored responses, the
model handles and the peer regions. The pipeline and the other routes take it whole; the unit
tests build it with fakes for the handles and the model states, and real everything else.
"""

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from serve_app import catalog
from serve_app.auth.authenticator import Authenticator
from serve_app.auth.keys import SCOPE_INFERENCE
from serve_app.auth.lease import LeasedRateLimiter
from serve_app.auth.principal import Principal
from serve_app.auth.ratelimit import SharedRateLimiter
from serve_app.config import AppArgs, MediaPolicy, ModelDeploymentArgs
from serve_app.errors import APIError
from serve_app.hot_load.tracker import ModelStates
from serve_app.router.client_socket import DEFAULT_STALL_TIMEOUT_S
from serve_app.router.failover import Forwarder
from serve_app.router.in_flight import InFlight
from serve_app.router.response_store import ResponseStore
from serve_app.router.responses import ResponsesAPI
from serve_app.usage.meter import Meter
from serve_app.usage.store import UsageStore


@dataclass(frozen=True)
class ModelFacts:
    """What the router needs to know of a model it serves to check and price a request."""

    context_len: int  # prompt plus completion, in tokens
    default_max_tokens: int | None  # the completion limit the router sets when a request sets none
    media: MediaPolicy = field(default_factory=MediaPolicy)  # which media parts its requests may carry
    task: str = "generate"  # the surfaces it serves (catalog.CatalogModel.task)

    @classmethod
    def of(cls, model: ModelDeploymentArgs) -> "ModelFacts":
        return cls(
            context_len=model.max_model_len, default_max_tokens=model.completion_default, media=model.media,
            task=catalog.get(model.id).task,
        )


@dataclass
class Services:
    region: str
    replica: str  # this router replica's Serve tag
    auth: Authenticator
    meter: Meter
    states: ModelStates
    in_flight: InFlight
    responses: ResponsesAPI
    forwarder: Forwarder
    handles: Mapping[str, Any]  # model id → its deployment's handle, options(stream=True)
    models: Mapping[str, ModelFacts]
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S  # a stream's client that reads nothing this long is cut
    max_resumes: int = 1  # a stream whose engine fails is resumed on another replica this often...
    resume_window_s: float = 30.0  # ...each within this long of the failure
    resume_here_s: float = 5.0  # this region's replicas first, this long; then a peer region's
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def build(cls, handles: Mapping[str, Any], args: AppArgs, *, app_name: str, replica: str) -> "Services":
        # Rate limits live in one actor per region, shared by every router replica. Look it up
        # (or start it) now: its worker process takes ~1 s to start, which the first request
        # would otherwise wait for, or be admitted unlimited when the limiter's 2 s timeout hits.
        limiter = SharedRateLimiter(args.region)
        limiter.actor()
        # Admission from a lease of the actor's budget: no actor call on the common path.
        auth = Authenticator(args.auth, args.region, LeasedRateLimiter(limiter))
        failover = args.failover
        return cls(
            region=args.region,
            replica=replica,
            auth=auth,
            # Usage records go to the key registry's database (one ledger for every region).
            meter=Meter(
                UsageStore(auth.keys.database), args.usage_spool_dir(), region=args.region, writer_id=replica,
                cache_ttl_s=args.auth.cache_ttl_s, flush_interval_s=args.usage.flush_interval_s,
            ),
            states=ModelStates(app_name, args.models),
            in_flight=InFlight(args.models),
            # Stored responses in the same registry database: every replica, pod and region sees them.
            responses=ResponsesAPI(ResponseStore(auth.keys.database, args.responses)),
            forwarder=Forwarder(
                args.region, failover.peers, connect_timeout_s=failover.connect_timeout_s,
                read_timeout_s=failover.read_timeout_s, max_attempts=failover.max_attempts,
                unreachable_hold_s=failover.unreachable_hold_s,
            ),
            handles={model_id: handle.options(stream=True) for model_id, handle in handles.items()},
            models={model.id: ModelFacts.of(model) for model in args.models},
            stall_timeout_s=args.router.stall_timeout_s,
            max_resumes=args.router.max_resumes,
            resume_window_s=args.router.resume_window_s,
            resume_here_s=args.router.resume_here_s,
        )

    def start(self) -> None:
        """Begin the background work (the ledger's writer, the stored responses' retention sweep);
        inside the replica's event loop."""
        self.meter.start()
        self.responses.store.start()

    async def aclose(self) -> None:
        """When the replica stops: end the state refresh and the sweep, write the usage records
        still pending (or spool them), close peer connections."""
        self.states.stop()
        await self.responses.store.aclose()
        await self.meter.aclose()
        await self.forwarder.aclose()

    async def caller(self, request: Any, scope: str = SCOPE_INFERENCE, *, api_key_header: bool = False) -> Principal:
        """Who sent ``request`` (401 / 403): its one credential, valid here and holding ``scope``."""
        authorization = self.auth.authorization(request.headers, api_key_header=api_key_header)  # 400 if two
        return await self.auth.authenticate_async(authorization, scope=scope)

    def resolve(self, name: Any) -> str:
        """A model name (canonical id, alias or HF repo id) as the canonical id served here (404)."""
        if not isinstance(name, str) or not name.strip():
            raise APIError(400, "you must provide a model parameter", param="model", code="missing_model")
        model_id = catalog.canonical_id(name)
        if model_id is None or model_id not in self.handles:
            raise APIError(
                404,
                f"The model {name!r} does not exist or is not served in region {self.region}. "
                f"Served here: {', '.join(self.handles)}",
                param="model",
                code="model_not_found",
            )
        return model_id
