"""``serve-app gpu-smoke``: a region's serving path on one Blackwell GPU, for an operator in the image.

    serve-app gpu-smoke --region yul-02            # start the region's app on this GPU, then test it
    serve-app gpu-smoke --region yul-02 --url https://api.yul-02.edge.polargrid.ai --api-key pgk_...

1. CUDA: torch sees a GPU of the region's Blackwell type (``gpu_smoke_checks.check_cuda``).
2. The vLLM flags the region's replicas start with, from ``configs/<region>.yaml``: the FP8
   checkpoint with no ``--quantization``, the 8192 cap, eager mode, the Qwen3.6 parsers, the
   region's ``gpu_memory_utilization``/``max_num_seqs`` and, when on, its speculative config.
3. Without ``--url``: the region's application on a Ray instance of its own (never a cluster
   this pod already belongs to), on 127.0.0.1 only, with one router and one replica of the model
   (those flags, the region's accelerator type), no failover peers and tracing off (the region's
   collector is in-cluster); a throwaway key store, signing keyset and API key in a temp dir.
   The first start downloads the checkpoint (~35 GB) into ``HF_HOME``.
4. ``/health``, then one streamed chat (TTFT and tokens/s on this client's clock), one tool call
   and one json_schema request through the router, with the official openai SDK.

Exit 0 when everything passed, 1 when a check failed, 2 on bad arguments. torch, Ray, vLLM and
openai are imported only by the steps that need them, so ``--help`` and the tests load none.
"""

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from serve_app import catalog
from serve_app.config import REQUEST_TIMEOUT_S, parse_app_args
from serve_app.devtools.local_services import free_port, wait_healthy
from serve_app.devtools.serve_cli import deploy_or_raise
from serve_app.image.gpu_smoke_checks import Check, check_cuda, run_requests
from serve_app.paths import REPO_ROOT
from serve_app.regions import layout

APPLICATION = "llm"
HAPROXY_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")


class SmokeError(ValueError):
    """Arguments that name no usable region config or model (exit 2)."""


def region_app_args(config: dict[str, Any]) -> dict[str, Any]:
    """The settings of a rendered region config's region (its ``llm`` router's, as written)."""
    try:
        return layout.region_args(config, APPLICATION)
    except ValueError as err:
        raise SmokeError(str(err)) from None


def load_region_args(region: str, repo: Path = REPO_ROOT) -> dict[str, Any]:
    path = repo / "configs" / f"{region}.yaml"
    if region == "local" or not path.exists():
        known = sorted(p.stem for p in (repo / "configs").glob("*.yaml") if p.stem != "local")
        raise SmokeError(f"no region config configs/{region}.yaml (regions: {', '.join(known)})")
    return region_app_args(yaml.safe_load(path.read_text()))


def pick_model(args: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The region's deployment of ``model`` (any accepted name), or its first model."""
    models = args.get("models") or []
    if model is None:
        return models[0]
    wanted = catalog.canonical_id(model)
    for entry in models:
        if entry["id"] == wanted:
            return entry
    raise SmokeError(f"{model!r} is not served by region {args.get('region')!r} "
                     f"(it serves {', '.join(m['id'] for m in models)})")


def engine_flags(args: dict[str, Any], model: str | None = None) -> list[str]:
    """The vLLM flags the region's replicas of ``model`` start with (what the replica parses)."""
    entry = pick_model(args, model)
    (deployment,) = parse_app_args({**args, "models": [entry]}).models
    return deployment.engine_cli_args(catalog.get(deployment.id).hf_repo)


def smoke_app_args(args: dict[str, Any], model: str | None, auth_dir: Path) -> dict[str, Any]:
    """The region's args cut down to one GPU: its engine flags and resources for one replica of one
    model, one router, auth files in ``auth_dir``, no peers, no trace export."""
    entry = dict(pick_model(args, model))
    entry.pop("initial_state", None)
    entry["autoscaling"] = {**entry.get("autoscaling", {}), "min_replicas": 1, "initial_replicas": 1,
                            "max_replicas": 1}
    smoke = {
        **args,
        "router": {**args.get("router", {}), "num_replicas": 1},
        # A throwaway SQLite store, never the region's shared registry.
        "auth": {**args["auth"], "key_store_path": str(auth_dir / "keys.sqlite3"), "key_registry_dsn_env": None,
                 "signing_keys_path": str(auth_dir / "signing-keys.json")},
        "failover": {"peers": []},
        "telemetry": {**args.get("telemetry", {}), "tracing": {"enabled": False}},
        "models": [entry],
    }
    parse_app_args(smoke)  # refuse here, not in a replica, anything that would not deploy
    return smoke


def create_smoke_key(auth_args: dict[str, Any]) -> str:
    """Key material the smoke app's routers read, and an inference key valid for an hour."""
    from serve_app.auth.config import AuthArgs
    from serve_app.auth.keys import KeyStore
    from serve_app.devtools.local_regions import create_key_material

    auth = AuthArgs.model_validate(auth_args)
    create_key_material(auth)
    key, _ = KeyStore(auth.key_store(), cache_ttl_s=0).create_key(
        owner="gpu-smoke", tier=auth.default_tier, expires_at=int(time.time()) + 3600
    )
    return key


def node_resources(args: dict[str, Any]) -> dict[str, float]:
    """What the smoke's one Ray node offers besides CPUs and the GPU: the resource a region's
    routers ask for, which only its head offers there (``router.resources``), for each router."""
    router = parse_app_args(args).router
    return {name: amount * router.num_replicas for name, amount in router.resources.items()}


@contextmanager
def local_region(args: dict[str, Any]) -> Iterator[str]:
    """The smoke app on a Ray instance of its own, deployed as a region is (``serve deploy`` of
    its applications); yields its base URL and stops both after."""
    import ray
    from ray import serve

    from serve_app.app import RAY_ENV

    os.environ.update(RAY_ENV)  # Ray reads it when it starts (HAProxy in front of the router)
    os.environ.update({name: str(free_port()) for name in HAPROXY_PORTS})  # beside a running Ray
    port, dashboard_port = free_port(), free_port()
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port, "request_timeout_s": REQUEST_TIMEOUT_S},
        "applications": layout.region_applications(args, name=APPLICATION, route_prefix="/"),
    }
    ray.init(address="local", include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=dashboard_port,
             resources=node_resources(args))
    try:
        deploy_or_raise(config, f"http://127.0.0.1:{dashboard_port}")
        yield f"http://127.0.0.1:{port}"  # _smoke waits for /health
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def health_check(url: str, timeout_s: float) -> Check:
    try:
        seconds = wait_healthy(url, timeout_s, poll_s=5)
    except RuntimeError as err:
        return Check("health", False, str(err))
    return Check("health", True, f"{url}/health 200 after {seconds:.0f} s")


def _report(checks: list[Check]) -> None:
    for check in checks:
        typer.echo(check.line())


def _smoke(url: str, api_key: str, model_id: str, health_timeout_s: float) -> list[Check]:
    import openai

    checks = [health_check(url, health_timeout_s)]
    _report(checks)
    if checks[0].ok:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=600)
        checks += run_requests(client, model_id)
        _report(checks[1:])
    return checks


def command(
    region: Annotated[str, typer.Option(help="Region id: its configs/<region>.yaml is what is tested.")],
    url: Annotated[str | None, typer.Option(help="A running router to test instead of starting one.")] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar="SERVE_APP_API_KEY", help="Key or token for --url (inference scope).")
    ] = None,
    model: Annotated[str | None, typer.Option(help="Model to test (default: the region's first).")] = None,
    skip_cuda: Annotated[bool, typer.Option(help="Skip the GPU check (with --url from a machine without one).")] = False,
    startup_timeout_s: Annotated[float, typer.Option(help="How long /health may take to answer 200.")] = 1800,
) -> None:
    """Check CUDA, load the region's model with its engine flags, and serve a chat, a tool call and
    a json_schema request through the router; print TTFT and tokens/s. Exit 1 on any failure."""
    try:
        args = load_region_args(region)
        entry = pick_model(args, model)
        flags = engine_flags(args, model)
        if url is not None and not api_key:
            raise SmokeError("--url needs --api-key (or SERVE_APP_API_KEY)")
    except (SmokeError, ValueError) as err:
        typer.echo(f"gpu-smoke: {err}", err=True)
        raise typer.Exit(2) from None
    accelerator = (entry.get("resources") or {}).get("accelerator_type") or ""
    checks = [] if skip_cuda else [check_cuda(accelerator)]
    _report(checks)
    typer.echo(f"vLLM flags of {region}'s {entry['id']} replicas: {' '.join(flags)}")
    if checks and not checks[0].ok:
        raise typer.Exit(1)
    if url is not None:
        checks += _smoke(url.rstrip("/"), api_key, entry["id"], startup_timeout_s)
    else:
        with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as auth_dir:
            smoke_args = smoke_app_args(args, model, Path(auth_dir))
            key = create_smoke_key(smoke_args["auth"])
            typer.echo(f"starting {region}'s application here (first start downloads the checkpoint)")
            try:
                with local_region(smoke_args) as local_url:
                    checks += _smoke(local_url, key, entry["id"], startup_timeout_s)
            except Exception as err:  # serve deploy refused the config, or Ray did not start
                checks.append(Check("deploy", False, f"{type(err).__name__}: {err}"))
                _report(checks[-1:])
    failed = [c.name for c in checks if not c.ok]
    typer.echo(f"gpu-smoke {region}: {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}")
    if failed:
        raise typer.Exit(1)
