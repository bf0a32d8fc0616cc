"""The AMX permission plugin (serve_app/engine/amx.py): asked for exactly where the CPU has AMX
tiles, and registered where vLLM looks for it in every one of its processes."""

import tomllib
from importlib.metadata import entry_points

import torch

from serve_app.engine import amx
from tests.conftest import REPO


def _cpu(monkeypatch, *, tiles: bool, granted: bool = True) -> list[str]:
    asked: list[str] = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: tiles)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append("arch_prctl") or granted)
    return asked


def test_the_permission_is_asked_for_where_the_cpu_has_amx_tiles(monkeypatch):
    asked = _cpu(monkeypatch, tiles=True)
    amx.request_amx_tiles()
    amx.request_amx_tiles()  # vLLM may load its plugins twice in one process
    assert asked == ["arch_prctl", "arch_prctl"]


def test_nothing_is_asked_for_without_amx(monkeypatch):
    asked = _cpu(monkeypatch, tiles=False)
    amx.request_amx_tiles()
    assert asked == []


def test_a_refusal_is_logged_not_raised(monkeypatch):
    _cpu(monkeypatch, tiles=True, granted=False)
    logged: list[str] = []
    monkeypatch.setattr(amx.logger, "warning", lambda message, *args: logged.append(message % args))
    amx.request_amx_tiles()
    assert len(logged) == 1 and "refused" in logged[0]


def test_vllm_finds_the_plugin_in_its_general_plugins_group():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert declared["serve_app_amx"] == "serve_app.engine.amx:request_amx_tiles"
    installed = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert installed.get("serve_app_amx") == declared["serve_app_amx"]
