"""Scheduling priority per tier: the engine runs with vLLM's priority policy, and the router sets
each request's priority from its key's tier, letting a request lower it but never raise it."""

from types import SimpleNamespace

import pytest

from serve_app import catalog
from serve_app.auth.config import DEFAULT_TIERS
from serve_app.config import ModelDeploymentArgs
from serve_app.errors import APIError
from serve_app.router.request_schema import validate_body
from tests.unit.auth_support import authenticator


@pytest.mark.parametrize("model_id", list(catalog.CATALOG))
def test_every_model_runs_with_priority_scheduling(model_id):
    args = ModelDeploymentArgs(id=model_id).engine_cli_args("/weights")
    assert args[args.index("--scheduling-policy") + 1] == "priority"


def test_interactive_tiers_are_scheduled_before_batch():
    assert DEFAULT_TIERS["enterprise"].priority < DEFAULT_TIERS["standard"].priority
    assert DEFAULT_TIERS["standard"].priority < DEFAULT_TIERS["free"].priority < DEFAULT_TIERS["batch"].priority


@pytest.mark.parametrize(
    "requested, expected",
    [(None, 10), (50, 50), (10, 10), (0, 10), (True, 10), ("0", 10)],  # lower: yes; higher: no
)
def test_a_request_may_lower_its_priority_but_never_raise_it(tmp_path, requested, expected):
    auth = authenticator(tmp_path)
    auth.args.tiers["standard"] = DEFAULT_TIERS["standard"]  # priority 10
    assert auth.priority(SimpleNamespace(tier="standard"), requested) == expected


def test_a_negative_priority_is_a_400_naming_it():
    with pytest.raises(APIError) as refused:
        validate_body("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": -1})
    assert refused.value.param == "priority"
