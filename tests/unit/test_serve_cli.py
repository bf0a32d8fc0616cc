"""``serve deploy`` from our commands (serve_app/devtools/serve_cli.py): the CLI gets
``RAY_AUTH_MODE=token`` where Ray would find a token and the caller chose no mode, never a
driver's ``RAY_ADDRESS``; and "a token exists" means what Ray's own loader says it means."""

import json
import subprocess
import sys
from dataclasses import asdict

import pytest

from serve_app.devtools.serve_cli import cli_env, settled, token_available
from tests.unit.serve_status import as_printed, status_of


@pytest.fixture
def home(tmp_path):
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def _write_token(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("a" * 32)
    return path


def test_a_token_in_the_home_directory_turns_the_mode_on(home):
    _write_token(home / ".ray" / "auth_token")
    assert cli_env({"PATH": "/bin"}, home) == {"PATH": "/bin", "RAY_AUTH_MODE": "token"}


def test_a_token_in_the_environment_or_a_named_file_turns_it_on(home, tmp_path):
    assert cli_env({"RAY_AUTH_TOKEN": "secret"}, home)["RAY_AUTH_MODE"] == "token"
    named = _write_token(tmp_path / "elsewhere" / "token")
    assert cli_env({"RAY_AUTH_TOKEN_PATH": str(named)}, home)["RAY_AUTH_MODE"] == "token"


def test_no_token_anywhere_leaves_the_mode_unset(home, tmp_path):
    assert "RAY_AUTH_MODE" not in cli_env({}, home)
    assert "RAY_AUTH_MODE" not in cli_env({"RAY_AUTH_TOKEN": "  "}, home)
    # A named file that does not exist is where Ray looks, instead of the home directory's.
    _write_token(home / ".ray" / "auth_token")
    assert "RAY_AUTH_MODE" not in cli_env({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")}, home)


def test_the_callers_choice_wins_and_a_drivers_address_is_dropped(home):
    _write_token(home / ".ray" / "auth_token")
    env = cli_env({"RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": "auto", "HOME": str(home)}, home)
    assert env == {"RAY_AUTH_MODE": "disabled", "HOME": str(home)}


RAY_SAYS = """
import json
from ray._raylet import AuthenticationTokenLoader
print(json.dumps(AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True)))
"""


CASES = ["nowhere", "home", "env", "named", "named missing", "empty home file", "blank first line",
         "blank env token beside a home one", "empty env token beside a home one"]


@pytest.mark.parametrize("where", CASES)
def test_token_available_agrees_with_rays_loader(where, home, tmp_path):
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    home_token = home / ".ray" / "auth_token"
    if where == "home":
        _write_token(home_token)
    elif where == "env":
        env["RAY_AUTH_TOKEN"] = "b" * 32
    elif where == "named":
        env["RAY_AUTH_TOKEN_PATH"] = str(_write_token(tmp_path / "named" / "token"))
    elif where == "named missing":  # Ray does not fall back to the home directory's: it refuses
        env["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "absent")
        _write_token(home_token)
    elif where == "empty home file":
        _write_token(home_token).write_text("")
    elif where == "blank first line":  # Ray reads the first line only
        _write_token(home_token).write_text("\n" + "c" * 32 + "\n")
    elif where == "blank env token beside a home one":  # a set variable decides alone
        env["RAY_AUTH_TOKEN"] = "  "
        _write_token(home_token)
    elif where == "empty env token beside a home one":  # an empty one counts as unset
        env["RAY_AUTH_TOKEN"] = ""
        _write_token(home_token)
    ray = subprocess.run([sys.executable, "-c", RAY_SAYS], env=env, capture_output=True, text=True, timeout=120)
    if where == "named missing":
        assert "RAY_AUTH_TOKEN_PATH is set but file cannot be opened" in ray.stderr, ray.stderr[-2000:]
        assert token_available(env, home) is False
        return
    assert ray.returncode == 0, ray.stderr[-2000:]
    assert token_available(env, home) is json.loads(ray.stdout.strip().splitlines()[-1])


# ``settled``: what a deploy waits for before it measures or changes anything more. Both shapes it
# reads: ``asdict(serve.status())`` (Serve's enums) and what ``serve status`` prints (plain strings).
@pytest.mark.parametrize("as_read", [asdict, as_printed], ids=["serve.status()", "serve status CLI"])
def test_settled_means_deployed_since_running_and_every_replica_running(as_read):
    def status(**apps):
        return as_read(status_of({name: (s, t, {"D": replicas}) for name, (s, t, replicas) in apps.items()}))

    running = ("RUNNING", 100.0, {"RUNNING": 2})
    assert settled(status(llm=running, model=("RUNNING", 100.0, {})), 99.0)  # a replica-less ingress too
    assert not settled(status(llm=running), 101.0)  # not yet applied: deployed before the call
    assert not settled(status(llm=("DEPLOYING", 100.0, {"RUNNING": 2})), 99.0)
    for state in ("STARTING", "UPDATING", "STOPPING", "RECOVERING"):
        assert not settled(status(llm=("RUNNING", 100.0, {"RUNNING": 1, state: 1})), 99.0), state
    assert settled(status(llm=("RUNNING", 100.0, {"RUNNING": 1, "STOPPING": 0})), 99.0)  # a zero count
    other = status(llm=running, old=("DEPLOYING", 50.0, {"STARTING": 1}))
    assert settled(other, 99.0, apps=["llm"]) and not settled(other, 99.0)  # only the ones named
    assert not settled(status(llm=running), 99.0, apps=["llm", "missing"])
    assert not settled({}, 0.0) and not settled({"applications": {}}, 0.0)  # nothing deployed
