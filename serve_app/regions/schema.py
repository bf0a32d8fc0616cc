"""Regions: ``regions/<id>.yaml`` is the single source for a region's Serve config and Terraform.

A region file states the facts of one edge region (where it is, its Blackwell GPUs, which catalog
models it serves with which replica bounds, its failover peers, its public endpoint, pilot or GA).
This module is its schema and loader: every file validated on its own and as a set, with every
problem named by file and field. ``serve_app.regions.render`` turns the regions into the Serve
configs and Terraform files (``serve-app regions render``).

Nothing here imports Ray or vLLM.
"""

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from serve_app import catalog
from serve_app.config import Autoscaling, MediaPolicy, replica_bounds_problem
from serve_app.paths import REPO_ROOT
from serve_app.regions import gpu_memory, layout
from serve_app.regions.kubernetes import K8S_NAME, RegionKubernetes, secret_name
from serve_app.settings import FrozenSettings, describe_errors, listed_twice
from serve_app.wire.tls import STREAM_TLS_NAME

# Blackwell GPUs, spelled as Ray's accelerator types (ray.util.accelerators: NVIDIA_B200,
# NVIDIA_RTX_PRO_6000), with the CUDA compute capability each reports (the GPU smoke test checks
# it): B200 is sm_100, the RTX PRO 6000 Blackwell sm_120. Ray detects the same names on the
# nodes, so `accelerator_type` pins replicas without any custom resource.
BLACKWELL_CAPABILITY = {"B200": (10, 0), "RTX-PRO-6000": (12, 0)}
BLACKWELL_ACCELERATORS = tuple(BLACKWELL_CAPABILITY)

DNS_ZONE = "edge.polargrid.ai"
GLOBAL_HOSTNAME = f"api.{DNS_ZONE}"  # latency-routed across GA regions (terraform/global)

_REGION_ID = re.compile(r"^[a-z]{3}-[0-9]{2}$")  # IATA code of the nearest airport + index
_AWS_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-[0-9]$")


# What the head's own processes need beside the routers: the GCS, the Serve controller, the
# dashboard, HAProxy and Serve's proxy. They ask Ray for no CPU: this sizes the pod, Ray reserves
# nothing for them.
HEAD_OWN_CPUS = 1


def public_endpoint(region_id: str) -> str:
    """A region's router, as clients and failover peers reach it."""
    return f"https://api.{region_id}.{DNS_ZONE}"


class RegionError(ValueError):
    """A region file, or the set of them, is invalid; the message lists every problem."""


class GpuNode(FrozenSettings):
    name: str = Field(description="Kubernetes node name of a GPU server in the region.")
    gpus: int = Field(ge=1, le=8, description="Blackwell GPUs on that node.")

    @field_validator("name")
    @classmethod
    def _node_name(cls, value: str) -> str:
        if not K8S_NAME.match(value):
            raise ValueError(f"{value!r} is not a valid Kubernetes node name")
        return value


class GpuPool(FrozenSettings):
    """The region's Blackwell GPU node pool: labelled and tainted by Terraform."""

    accelerator_type: str = Field(description=f"Ray accelerator type: {' or '.join(BLACKWELL_ACCELERATORS)}.")
    count: int = Field(ge=1, description="GPUs in the pool; every model replica takes one, or its share of one.")
    nodes: list[GpuNode] = Field(min_length=1)

    @field_validator("accelerator_type")
    @classmethod
    def _blackwell(cls, value: str) -> str:
        if value not in BLACKWELL_ACCELERATORS:
            raise ValueError(
                f"{value!r} is not a Blackwell Ray accelerator type "
                f"(allowed: {', '.join(BLACKWELL_ACCELERATORS)})"
            )
        return value

    @model_validator(mode="after")
    def _nodes_add_up(self) -> "GpuPool":
        if twice := listed_twice(n.name for n in self.nodes):
            raise ValueError(f"GPU nodes listed twice: {', '.join(twice)}")
        on_nodes = sum(n.gpus for n in self.nodes)
        if on_nodes != self.count:
            raise ValueError(f"count is {self.count} but the nodes carry {on_nodes} GPUs")
        return self


class Replicas(FrozenSettings):
    """Autoscaling bounds of one model in one region (each replica takes its model's ``gpus``)."""

    min: int = Field(ge=1, description="Never zero: a cold start loads ~35 GB of weights.")
    initial: int | None = Field(None, ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> "Replicas":
        if problem := replica_bounds_problem(self.min, self.initial, self.max, ("min", "initial", "max")):
            raise ValueError(problem)
        return self


class SpeculativeDecoding(FrozenSettings):
    """Opt-in MTP speculative decoding: the checkpoint's own multi-token-prediction layers draft
    tokens that the model verifies in one forward pass (docs/regions.md, "MTP speculative decoding")."""

    method: Literal["mtp"] = Field(description="The catalog model's speculative method; only mtp.")
    num_speculative_tokens: int = Field(
        1, ge=1, le=4, description="Draft tokens per step; vLLM warns that >1 reruns the one MTP layer."
    )


class RegionModel(FrozenSettings):
    """One catalog model as a region serves it. Model facts (checkpoint, FP8, the 8192-token cap,
    eager mode, parsers) come from the catalog and cannot be changed here."""

    id: str = Field(description="Canonical catalog id.")
    replicas: Replicas
    # Serving knobs that ModelDeploymentArgs and its Autoscaling take too (serve_config.model_args
    # passes each through). The app's defaults (serve_app/config/) suit the CPU default's
    # replica, 16 sequences at once (configs/local.yaml); a region's replica is one Blackwell GPU
    # running max_num_seqs (64), so these differ on purpose: max_ongoing_requests 1.5 x
    # max_num_seqs, so the engine keeps a queue of its own (_target_admitted), the target and the
    # router's queue scaled with it; and a slower scale-down, since a replica's cold start loads
    # ~35 GB of weights. The scale-up delay is the app's.
    target_ongoing_requests: int = Field(24, ge=1, description="Autoscaling target per replica.")
    max_ongoing_requests: int = Field(
        96, ge=1, description="What one replica admits into vLLM: more than max_num_seqs, so the engine keeps a queue."
    )
    max_queued_requests: int = Field(128, ge=1, description="Beyond this the router sheds load (503).")
    upscale_delay_s: float = Field(Autoscaling.model_fields["upscale_delay_s"].default, ge=0)
    downscale_delay_s: float = Field(600, ge=0)
    cpus: float = Field(8, gt=0, description="Ray CPUs per replica (tokenisation, detokenisation).")
    gpus: float = Field(
        1, gt=0, le=1,
        description="GPUs per replica: 1, or a fraction to share each GPU with the region's other fractional "
        "models (gpu_memory.py: gpu_memory_utilization then explicit, within the fraction).",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="vLLM's tokens per engine step; None: vLLM's default."
    )
    state: Literal["loaded", "cold"] = Field(
        "loaded", description="At deploy. cold: no replicas until an admin POSTs /v1/models/load."
    )
    speculative_decoding: SpeculativeDecoding | None = Field(
        None, description="Off unless set: faster decode at low concurrency, for some GPU memory."
    )
    region_health: Literal["required", "optional"] = Field(
        "optional",
        description="required: the region's /health (Route 53's check) is 503 while this model serves on "
        "no replica; optional: the region stays in the global name, this model's requests fail over.",
    )

    @field_validator("id")
    @classmethod
    def _in_catalog(cls, value: str) -> str:
        if value in catalog.CATALOG:
            return value
        canonical = catalog.canonical_id(value)
        hint = f"; use its canonical id {canonical!r}" if canonical else ""
        raise ValueError(
            f"{value!r} is not a canonical catalog id (known: {', '.join(catalog.CATALOG)}){hint}"
        )

    @model_validator(mode="after")
    def _speculative_offered(self) -> "RegionModel":
        wanted, offered = self.speculative_decoding, catalog.get(self.id).speculative_method
        if wanted is not None and wanted.method != offered:
            offers = f"only {offered!r}" if offered else "no speculative method"
            raise ValueError(f"speculative_decoding: {self.id} offers {offers}, not {wanted.method!r}")
        return self

    @model_validator(mode="after")
    def _required_is_loaded(self) -> "RegionModel":
        if self.region_health == "required" and self.state == "cold":
            raise ValueError(f"{self.id}: region_health: required needs state: loaded (a cold model would keep "
                             "/health 503)")
        return self

    @model_validator(mode="after")
    def _target_admitted(self) -> "RegionModel":
        if self.target_ongoing_requests > self.max_ongoing_requests:
            raise ValueError(
                f"target_ongoing_requests ({self.target_ongoing_requests}) > max_ongoing_requests "
                f"({self.max_ongoing_requests}): a replica could never reach its scaling target"
            )
        if self.max_ongoing_requests <= self.max_num_seqs:
            # Serve's queue re-polls for a free replica with a backoff; vLLM's refills at once.
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) must exceed max_num_seqs "
                f"({self.max_num_seqs}) so the engine keeps a queue of its own (docs/architecture.md)"
            )
        return self


class RegionRouter(FrozenSettings):
    replicas: int = Field(2, ge=1)
    cpus: float = Field(1, ge=0)


class Region(FrozenSettings):
    id: str = Field(description="IATA code of the nearest airport plus an index, e.g. yul-02.")
    location: str = Field(min_length=1)
    status: Literal["pilot", "ga"] = Field(
        description="pilot: reachable at its own endpoint only; ga: also behind the global name."
    )
    draining: bool = Field(
        False,
        description="A ga region out of the global name's DNS answers (maintenance): its own endpoint, a "
        "resolver's cached answer and its peers' failover still reach it (docs/operations.md, \"Draining a region\").",
    )
    public_endpoint: str = Field(description=f"https://api.<id>.{DNS_ZONE}")
    route53_latency_region: str = Field(
        description="The AWS region whose latency stands for this region in Route 53 latency routing."
    )
    peers: list[str] = Field(default_factory=list, description="Failover peers, most preferred first.")
    gpu: GpuPool
    router: RegionRouter = RegionRouter()
    models: list[RegionModel] = Field(min_length=1)
    kubernetes: RegionKubernetes = RegionKubernetes()
    otlp_endpoint: str = Field(description="OTLP collector the region's routers export traces to.")
    otlp_protocol: Literal["grpc", "http/protobuf"] = Field(
        "grpc", description="grpc: the collector's :4317 (host:port); http/protobuf: its :4318."
    )
    trace_sampling_ratio: float = Field(
        0.1, ge=0, le=1, description="Share of new traces recorded; a caller's traceparent decides for its own."
    )
    media: MediaPolicy = Field(
        MediaPolicy(),
        description="Images, audio and video in requests: off (text only), or {allowed_domains: [host, ...]}, "
        "the hosts the engine may fetch them from (docs/regions.md, \"Media\").",
    )
    stream_tls_secret: str | None = Field(
        None,
        description="TLS on the router-replica byte socket: the Kubernetes Secret in the region's namespace "
        f"holding tls.crt and tls.key (for {STREAM_TLS_NAME}) and ca.crt. Unset: plaintext inside the "
        "NetworkPolicy (docs/threat-model.md, \"The stream listener\", has the measured cost).",
    )

    @field_validator("stream_tls_secret")
    @classmethod
    def _secret_name(cls, value: str | None) -> str | None:
        return value if value is None else secret_name(value)

    @field_validator("id")
    @classmethod
    def _id_shape(cls, value: str) -> str:
        if not _REGION_ID.match(value):
            raise ValueError(f"{value!r} is not a region id like 'yul-02' (IATA code, dash, two digits)")
        return value

    @field_validator("route53_latency_region")
    @classmethod
    def _aws_region(cls, value: str) -> str:
        if not _AWS_REGION.match(value):
            raise ValueError(f"{value!r} is not an AWS region code like 'ca-central-1'")
        return value

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+$", value):
            raise ValueError(f"{value!r} is not an http(s)://host:port URL")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "Region":
        port = self.otlp_endpoint.rsplit(":", 1)[-1]
        wrong_port = {"grpc": "4318", "http/protobuf": "4317"}[self.otlp_protocol]
        if port == wrong_port:
            raise ValueError(
                f"otlp_endpoint {self.otlp_endpoint!r} is the collector's "
                f"{'http/protobuf' if port == '4318' else 'grpc'} port, but otlp_protocol is {self.otlp_protocol!r}"
            )
        expected = public_endpoint(self.id)
        if self.public_endpoint != expected:
            raise ValueError(f"public_endpoint must be {expected!r}, got {self.public_endpoint!r}")
        if self.draining and self.status != "ga":
            raise ValueError("draining: only a ga region is behind the global name; a pilot region has none to leave")
        if self.id in self.peers:
            raise ValueError(f"peers: a region cannot be its own failover peer ({self.id!r})")
        if twice := listed_twice(self.peers):
            raise ValueError(f"peers listed twice: {', '.join(twice)}")
        if twice := listed_twice(m.id for m in self.models):
            raise ValueError(f"models listed twice: {', '.join(twice)}")
        wanted = round(sum(m.replicas.max * m.gpus for m in self.models), 6)
        whole = sum(m.replicas.max for m in self.models if m.gpus > 0.5)  # never two on one GPU
        if wanted > self.gpu.count or whole > self.gpu.count:
            raise ValueError(
                f"the models' max replicas add up to {max(wanted, whole):g} GPUs but the region has {self.gpu.count} "
                f"{self.gpu.accelerator_type} (a replica takes its gpus, and no two of more than half fit one GPU)"
            )
        if problems := gpu_memory.problems(self.models, self.gpu.accelerator_type):
            raise ValueError("; ".join(problems))
        # A worker pod holds one GPU: a whole-GPU replica, or one replica of each sharing model.
        widest = max([m.cpus for m in self.models if m.gpus == 1] + [sum(m.cpus for m in gpu_memory.shared(self.models))])
        if self.kubernetes.gpu_worker.cpus < widest:
            raise ValueError(
                f"kubernetes.gpu_worker.cpus ({self.kubernetes.gpu_worker.cpus}) is less than a model "
                f"replica needs ({widest:g})"
            )
        # The routers run on the head alone (the credentials are there only: serve_config.py
        # ROUTER_NODE_RESOURCE), and a rolling update starts each replacement before it stops
        # the replica it replaces (layout.SURGE_PERCENT): with room for fewer it replaces a few at
        # a time, with none the replacements wait. Beside them the head runs its own processes.
        replicas = self.router.replicas + -(-self.router.replicas * layout.SURGE_PERCENT // 100)
        needed = replicas * self.router.cpus + HEAD_OWN_CPUS
        if self.kubernetes.head.cpus < needed:
            raise ValueError(
                f"kubernetes.head.cpus ({self.kubernetes.head.cpus}) cannot hold the routers, a rolling "
                f"update's replacements beside them and the head's own processes ({replicas} x "
                f"{self.router.cpus:g} + {HEAD_OWN_CPUS} CPUs)"
            )
        return self

    @property
    def public_host(self) -> str:
        return self.public_endpoint.removeprefix("https://")

    @property
    def behind_global_name(self) -> bool:
        """Route 53 answers the global name with this region (terraform/global/global_name.tf)."""
        return self.status == "ga" and not self.draining


# --- loading -----------------------------------------------------------------------------------


def parse_region(raw: Any, source: str = "region") -> Region:
    """Validate one region's data; RegionError names the file and every problem in it."""
    if not isinstance(raw, dict):
        raise RegionError(f"{source}: expected a mapping at the top level")
    try:
        return Region.model_validate(raw)
    except ValidationError as err:
        raise RegionError("\n".join(f"{source}: {p}" for p in describe_errors(err, "(file)"))) from None


def load_region(path: Path) -> Region:
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise RegionError(f"{path.name}: not valid YAML: {err}") from None
    region = parse_region(raw, f"regions/{path.name}")
    if region.id != path.stem:
        raise RegionError(f"regions/{path.name}: id {region.id!r} does not match the file name")
    return region


def check_region_set(regions: dict[str, Region]) -> None:
    """Rules across region files: peers exist, no two regions share a latency region, and draining
    leaves the global name a region to answer with."""
    problems = []
    ga = [region for region in regions.values() if region.status == "ga"]
    if ga and all(region.draining for region in ga):
        problems.append(f"every ga region is draining: {GLOBAL_HOSTNAME} would have no region to answer with")
    for region in regions.values():
        for peer in region.peers:
            if peer not in regions:
                problems.append(
                    f"regions/{region.id}.yaml: peers: unknown region {peer!r} (known: {', '.join(regions)})"
                )
    by_latency: dict[str, list[str]] = {}
    for region in regions.values():
        by_latency.setdefault(region.route53_latency_region, []).append(region.id)
    for aws_region, ids in by_latency.items():
        if len(ids) > 1:
            problems.append(
                f"regions {', '.join(ids)} share route53_latency_region {aws_region!r}: "
                "latency routing needs one record per AWS region"
            )
    if problems:
        raise RegionError("\n".join(problems))


def load_regions(directory: Path | None = None) -> dict[str, Region]:
    """Every ``regions/*.yaml``, validated one by one and as a set, sorted by id."""
    directory = directory or REPO_ROOT / "regions"
    paths = sorted(directory.glob("*.yaml"))
    if not paths:
        raise RegionError(f"no region files in {directory}")
    problems, regions = [], {}
    for path in paths:
        try:
            region = load_region(path)
        except RegionError as err:
            problems.append(str(err))
            continue
        regions[region.id] = region
    if problems:
        raise RegionError("\n".join(problems))
    check_region_set(regions)
    return regions
