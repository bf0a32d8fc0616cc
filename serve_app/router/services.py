"""What a router replica serves with: who is calling (``auth``), what they spent (``meter``), where
each model stands (``states``, ``in_flight``), stored responses, the model handles and the peer
regions. The pipeline and the other routes take it whole; the unit tests build it with fakes for
the handles and the model states, and real everything else.

Built from the router's first settings (its ``user_config``, serve_app/regions/layout.py) and
changed in place by the next ones (``reconfigure``): each part a change touches is rebuilt or
re-set, the rest kept, so in-flight requests finish on what they hold and no state is lost (the
rate limiter's leases, the ledger's pending records, the in-flight counts, the model states).
What a replica reads once when it starts (``layout.ROUTER_STARTUP``) never changes here.
"""

import asyncio
import functools
import time
from collections.abc import Callable
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
from serve_app.regions.layout import split_startup
from serve_app.router.client_socket import DEFAULT_STALL_TIMEOUT_S
from serve_app.router.call import ReplicaCall
from serve_app.router.failover import Forwarder
from serve_app.router.in_flight import InFlight
from serve_app.router.json_body import shown
from serve_app.router.lines import Lines
from serve_app.router.response_store import ResponseStore
from serve_app.router.responses import ResponsesAPI
from serve_app.usage.meter import Meter
from serve_app.usage.store import UsageStore
from serve_app.wire.messages import Call


@dataclass(frozen=True)
class ModelFacts:
    """What the router needs to know of a model it serves to check and price a request."""

    context_len: int  # prompt plus completion, in tokens
    default_max_tokens: int | None  # the completion limit the router sets when a request sets none
    media: MediaPolicy = field(default_factory=MediaPolicy)  # which media parts its requests may carry
    task: str = "generate"  # the surfaces it serves (catalog.CatalogModel.task)
    required_for_health: bool = False  # the region's /health is 503 while it serves nowhere here
    embedding_dimensions: int | None = None  # an embedding model's vector size (``dimensions`` may lower it)

    @classmethod
    def of(cls, model: ModelDeploymentArgs) -> "ModelFacts":
        card = catalog.get(model.id)
        return cls(
            context_len=model.max_model_len, default_max_tokens=model.completion_default, media=model.media,
            task=card.task, required_for_health=model.region_health == "required",
            embedding_dimensions=card.embedding_dimensions,
        )


HandleFor = Callable[[str], Any]  # a model id -> its deployment's handle


def _call_settings(args: AppArgs) -> dict[str, Any]:
    router = args.router
    return {"stall_timeout_s": router.stall_timeout_s, "hand_off": router.hand_off_streams,
            "handle_transport": router.handle_transport, "max_resumes": router.max_resumes,
            "resume_window_s": router.resume_window_s, "resume_here_s": router.resume_here_s}


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
    # Every model this replica has served, by id: a model its settings no longer list keeps its
    # handle and facts for the requests already on their way to it; ``served`` is what is listed.
    handles: dict[str, Any]  # model id → its deployment's handle, options(stream=True)
    models: dict[str, ModelFacts]
    args: AppArgs  # the settings these were built from
    served: tuple[str, ...] = ()  # the models served now, in the settings' order
    # How calls and streams go, from ``args.router`` (set from it, here so that a test can set them alone).
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S  # a stream's client that reads nothing this long is cut
    hand_off: bool = False  # a replica on this node writes a stream to the client itself (wire/handoff.py)
    # A call reaches its replica by Serve's gRPC, as a Ray actor task, or on the replica's direct line
    # (``router/lines.py``; through Serve's gRPC when the line does not take it).
    handle_transport: str = "direct"
    max_resumes: int = 1  # a stream whose engine fails is resumed on another replica this often...
    resume_window_s: float = 30.0  # ...each within this long of the failure
    resume_here_s: float = 5.0  # this region's replicas first, this long; then a peer region's
    created: int = field(default_factory=lambda: int(time.time()))
    _method_handles: dict[tuple[str, str, bool], Any] = field(default_factory=dict, repr=False)
    lines: Lines = field(default_factory=Lines, repr=False)  # the replicas' direct lines known here

    def __post_init__(self) -> None:
        self.served = self.served or tuple(model.id for model in self.args.models)

    @classmethod
    def build(cls, handle_for: HandleFor, args: AppArgs, *, app_name: str, replica: str) -> "Services":
        """``handle_for(model_id)``: the model's deployment handle (its own application's)."""
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
            handles={model.id: handle_for(model.id).options(stream=True) for model in args.models},
            models={model.id: ModelFacts.of(model) for model in args.models},
            args=args,
            **_call_settings(args),
        )

    async def reconfigure(self, args: AppArgs, handle_for: HandleFor) -> list[str]:
        """Serve from ``args`` on (the router's user_config changed): rebuild what the change
        needs and nothing else; the names of the sections that changed. ValueError when ``args``
        change what a replica reads only when it starts (Serve never does that: those are the
        router application's args, whose change restarts the replica)."""
        old = self.args
        if split_startup(_written(old))[0] != split_startup(_written(args))[0]:
            raise ValueError("these settings are read when a router replica starts: restart it to change them")
        changed = [name for name in ("router", "auth", "failover", "responses", "usage", "models") if getattr(old, name) != getattr(args, name)]
        auth = old_auth = self.auth
        if args.auth != old.auth:
            # A new key cache and keyset view (what the registry holds is unchanged); its key
            # store opens the same registry, so the ledger and the response store keep theirs.
            auth = await asyncio.to_thread(Authenticator, args.auth, args.region, self.auth.limiter)
            # Its store knows the key ids the old one listed: real keys are never budgeted as
            # made-up ids (503 key_registry_busy) while its own first listing runs.
            auth.keys.know_ids_of(old_auth.keys)
        added = {m.id: handle_for(m.id).options(stream=True) for m in args.models if m.id not in self.handles}
        # No await from here on: a request sees the old settings or the new ones, never a mix.
        self.auth = auth
        self.meter.budgets.cache_ttl_s = args.auth.cache_ttl_s
        self.meter.ledger.flush_interval_s = args.usage.flush_interval_s
        self.responses.store.apply(args.responses)
        failover = args.failover
        self.forwarder.apply(
            failover.peers, connect_timeout_s=failover.connect_timeout_s, read_timeout_s=failover.read_timeout_s,
            max_attempts=failover.max_attempts, unreachable_hold_s=failover.unreachable_hold_s,
        )
        self.states.set_models(args.models)
        self.in_flight.set_models(args.models)
        self.handles = {**self.handles, **added}
        self.models = {**self.models, **{model.id: ModelFacts.of(model) for model in args.models}}
        self.served = tuple(model.id for model in args.models)
        for name, value in _call_settings(args).items():
            setattr(self, name, value)
        self.args = args
        if auth is not old_auth:
            # The new one lists the registry's key ids, as the first did from start(); the old
            # one's listing and its read-ahead threads stop (a request still holding it looks
            # keys up all the same).
            auth.start()
            await old_auth.aclose()
        return changed

    def start(self) -> None:
        """Begin the background work (the ledger's writer, the stored responses' retention sweep,
        the registry's key ids listed); inside the replica's event loop."""
        self.meter.start()
        self.responses.store.start()
        self.auth.start()

    async def aclose(self) -> None:
        """When the replica stops: end the state refresh, the key id listing and the sweep, write the usage records
        still pending (or spool them), close peer connections."""
        self.states.stop()
        await self.meter.aclose()  # first: the records are what a stop past Serve's kill would lose
        await self.auth.aclose()
        await self.responses.store.aclose()
        await self.forwarder.aclose()
        self.lines.close()

    def replica_call(self, model: str, surface: str, call: Call) -> ReplicaCall:
        """``call`` to a replica of ``model``, for ``surface``, on the region's transport."""
        lines = self.lines if self.handle_transport == "direct" else None
        state = self.states.get(model)
        # A replica stopping (a redeploy, a scale-down) or updating in place: Serve knows which one
        # serves now, the line may not.
        replicas = state.running if not (state.stopping or state.updating) else 0
        serving = functools.partial(self.states.require_serving, model, self.region)
        return ReplicaCall(self.method_handle(model, surface), call, model, self.region, surface=surface, lines=lines,
                           replicas=replicas, serving=serving, on_unreachable=self.states.suspect)

    def method_handle(self, model: str, method: str) -> Any:
        """``handles[model]``'s ``method`` on the transport set (``handle_transport``), made once:
        Serve builds a new handle for every attribute read (``DeploymentHandle.options``, ~1 % of
        the router's CPU under load). A model's handle is never replaced (``reconfigure`` only
        adds), so neither is its methods'; a transport changed in place gets handles of its own."""
        by_reference = self.handle_transport == "actor"  # "direct" calls through the handle by gRPC
        key = (model, method, by_reference)
        found = self._method_handles.get(key)
        if found is None:
            by_value = self.handles[model].options(_by_reference=by_reference)
            found = self._method_handles[key] = getattr(by_value, method)
        return found

    async def caller(self, request: Any, scope: str = SCOPE_INFERENCE, *, api_key_header: bool = False) -> Principal:
        """Who sent ``request`` (401 / 403): its one credential, valid here and holding ``scope``."""
        authorization = self.auth.authorization(request.headers, api_key_header=api_key_header)  # 400 if two
        return await self.auth.authenticate_async(authorization, scope=scope)

    def resolve(self, name: Any, caller: Principal | None = None) -> str:
        """A model name (canonical id, alias or HF repo id) as the canonical id served here (404,
        naming the models served here that ``caller`` may use: a key kept to one model is not
        told which others the region serves, as ``GET /v1/models`` does not)."""
        if not isinstance(name, str):
            raise APIError(400, "invalid request: model: a model id or alias, a string", param="model")
        if not name.strip():
            raise APIError(400, "you must provide a model parameter", param="model", code="missing_model")
        model_id = catalog.canonical_id(name)
        if model_id is None or model_id not in self.served:
            raise APIError(
                404,
                f"The model {shown(name)!r} does not exist or is not served in region {self.region}. "
                f"Served here: {', '.join(self.usable_by(caller)) or 'none for this key'}",
                param="model",
                code="model_not_found",
            )
        return model_id

    def usable_by(self, caller: Principal | None) -> list[str]:
        """The models served here, those ``caller`` may use (all of them for no caller)."""
        return [model for model in self.served if caller is None or caller.allows_model(model)]


def _written(args: AppArgs) -> dict[str, Any]:
    return args.model_dump(mode="json")
