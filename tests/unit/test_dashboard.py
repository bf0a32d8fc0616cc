"""The Grafana dashboard the region module provisions queries only series that exist.

Ours come from ``serve_app.telemetry.metrics``; Ray Serve's from the installed Ray's own source
(every ``metrics.Counter/Gauge/Histogram("serve_...")`` it defines), read as text, so Ray is not
imported. vLLM's own ``vllm:*`` series are not on the dashboard: the model replicas' ``AsyncLLM``
keeps them in its process's Prometheus registry, which nothing scrapes.
"""

import importlib.util
import json
import re
from pathlib import Path

import hcl2

from serve_app.telemetry import metrics as telemetry_metrics
from tests.conftest import REPO

MODULE = REPO / "terraform" / "modules" / "region"
DASHBOARD = MODULE / "dashboards" / "serve_app.json"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_SERVE_METRIC = re.compile(r'metrics\.(Counter|Gauge|Histogram)\(\s*(?:name\s*=\s*)?"(serve_[a-z0-9_]+)"')


def exported_by_us() -> set[str]:
    names = {f"ray_{name}" for name in telemetry_metrics.COUNTERS}
    return names | {f"ray_{name}{s}" for name in telemetry_metrics.HISTOGRAMS for s in HISTOGRAM_SUFFIXES}


def exported_by_serve() -> set[str]:
    """Ray's Prometheus names for Serve's metrics: ``ray_`` + name; counters end in ``_total``."""
    (root,) = importlib.util.find_spec("ray.serve").submodule_search_locations
    names = set()
    for path in Path(root).rglob("*.py"):
        for kind, name in _SERVE_METRIC.findall(path.read_text()):
            if kind == "Counter":
                names.add(f"ray_{name}" if name.endswith("_total") else f"ray_{name}_total")
            elif kind == "Histogram":
                names |= {f"ray_{name}{s}" for s in HISTOGRAM_SUFFIXES}
            else:
                names.add(f"ray_{name}")
    return names


def queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return exprs + [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def series(exprs: list[str]) -> set[str]:
    return {m for expr in exprs for m in re.findall(r"\b(?:ray_|vllm:)[a-zA-Z0-9_:]+", expr)}


DASHBOARD_JSON = json.loads(DASHBOARD.read_text())
USED = series(queries(DASHBOARD_JSON))


def test_the_serve_metric_scan_finds_serves_series():
    serve = exported_by_serve()
    assert {"ray_serve_deployment_replica_healthy", "ray_serve_deployment_request_counter_total",
            "ray_serve_deployment_processing_latency_ms_bucket"} <= serve


def test_every_queried_series_is_one_serve_app_or_ray_serve_exports():
    unknown = USED - exported_by_us() - exported_by_serve()
    assert USED and not unknown, f"not exported by serve_app or Ray Serve {sorted(unknown)}"


def test_the_dashboard_shows_latency_tokens_status_replicas_ongoing_and_shedding():
    def shown(name: str) -> bool:
        return any(m.removesuffix(s) == f"ray_{name}" for m in USED for s in ("", *HISTOGRAM_SUFFIXES))

    m = telemetry_metrics
    for name in (m.TTFT, m.TPOT, m.QUEUE, m.INFERENCE, m.NETWORK, m.LATENCY, m.OUTPUT_TOKENS, m.CACHED_INPUT_TOKENS,
                 m.REQUESTS, m.ERRORS):
        assert shown(name), name
    exprs = queries(DASHBOARD_JSON)
    assert any("by (region, status)" in e and m.REQUESTS in e for e in exprs)
    assert any('code="overloaded"' in e for e in exprs), "the shed (503 overloaded) rate"
    for serve_series in ("ray_serve_deployment_replica_healthy", "ray_serve_replica_processing_queries",
                         "ray_serve_deployment_queued_queries"):
        assert serve_series in USED


def test_panels_have_unique_ids_and_grafana_datasource_references():
    panels = DASHBOARD_JSON["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] == "row":
            continue
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_the_region_module_provisions_this_file_as_a_labelled_configmap():
    doc = hcl2.loads((MODULE / "dashboard.tf").read_text())
    (resource,) = [r for r in doc["resource"] if '"kubernetes_config_map_v1"' in r]
    (config_map,) = resource['"kubernetes_config_map_v1"'].values()
    (metadata,) = config_map["metadata"]
    assert "grafana_dashboard" in metadata["labels"]
    (path,) = re.findall(r'file\("\$\{path\.module\}/([^"]+)"\)', " ".join(config_map["data"].values()))
    assert (MODULE / path).resolve() == DASHBOARD
