"""serve_app.client installs on a laptop: importing it loads neither Ray, vLLM, torch nor any of
the server's modules (checked in a fresh interpreter, since this test process has them loaded)."""

import json
import subprocess
import sys

from tests.conftest import REPO

SERVER_SIDE = ("ray", "vllm", "torch", "fastapi", "starlette", "uvicorn", "opentelemetry", "jwt", "yaml")


def test_importing_the_client_pulls_in_no_server_side_package():
    code = "import json, sys; import serve_app.client; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    modules = json.loads(done.stdout)
    heavy = [m for m in modules if m.split(".")[0] in SERVER_SIDE]
    ours = [m for m in modules if m.startswith("serve_app.") and not m.startswith("serve_app.client")]
    assert heavy == [] and ours == []
    assert "httpx" in modules and "pydantic" in modules  # the check would see them: it can fail


def test_the_package_root_stays_import_light():
    # serve_app/__init__.py is shared with the server; whatever it imports, the client imports.
    code = "import json, sys; import serve_app; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert [m for m in json.loads(done.stdout) if m.startswith("serve_app.")] == []
