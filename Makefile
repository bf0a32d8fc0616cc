# The README's two commands: `make run` (set up, then serve the embedded CPU default on
# 127.0.0.1:8000) and `make test` (set up, then run the whole test suite).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# checkov (Terraform checks in the unit tests) pins older packaging/networkx than the app: own venv.
TOOLS_VENV := .venv-tools

.PHONY: setup run test unit clean

# The two venvs install side by side (each is pip, mostly one busy core: 140 s for the tools
# alone). Output is not synced: a synced `make test` would print nothing until the suite ends.
MAKEFLAGS += --jobs=2

setup: $(VENV)/.installed $(TOOLS_VENV)/.installed

# Re-run the installer whenever the dependencies or the installer change.
$(VENV)/.installed: pyproject.toml scripts/install.py serve_app/devtools/tiny_model.py serve_app/devtools/tiny_embedding_model.py
	$(PYTHON) scripts/install.py --only app --venv $(VENV)
	touch $@

$(TOOLS_VENV)/.installed: pyproject.toml scripts/install.py
	$(PYTHON) scripts/install.py --only tools --tools-venv $(TOOLS_VENV)
	touch $@

# The local dev key (docs/auth.md): configs/local.yaml accepts this string as an all-access API
# key. Set SERVE_APP_DEV_API_KEY yourself to use another; region configs never accept one.
SERVE_APP_DEV_API_KEY ?= sk-local-dev
run: export SERVE_APP_DEV_API_KEY := $(SERVE_APP_DEV_API_KEY)
# The Ray node's environment (serve_app/app.py LOCAL_RAY_ENV) is set by serve_app.runtime.local_ray
# before Ray starts: HAProxy (bundled with Ray 2.60) on port 8000 in place of Serve's Python proxy,
# forwarding to the router's own port, through serve_app's launcher (docs/architecture.md, "The
# token path"); what an idle cluster costs (IDLE_ENV: docs/benchmarks.md, "The idle floor"); one
# HAProxy thread and the log monitor's listing on this small host. What you export yourself wins.
# Another local config with the same environment: `make run SERVE_CONFIG=configs/local-bench.yaml`
# (the benchmark's chat model alone, docs/benchmarks.md).
SERVE_CONFIG ?= configs/local.yaml
# On a CPU host every process of the Ray node but the engine keeps off the cores vLLM's worker
# computes on (serve_app/runtime/cpus.py): Ray starts on the last CPU, the one vLLM reserves, and
# the model replica gives its engine the whole host; SERVE_APP_GATEWAY_CPUS names other CPUs, or
# none (empty). `serve run` through serve_app.runtime.local_ray: the node's dashboard runs the
# modules the service uses (Serve's API, the state API, the metrics list); SERVE_APP_DASHBOARD_MODULES=all
# brings back the web UI's other pages.
run: $(VENV)/.installed
	SERVE_APP_GATEWAY_CPUS=$$($(BIN)/python -m serve_app.runtime.cpus) \
	  $(BIN)/python -m serve_app.runtime.cpus $(BIN)/python -m serve_app.runtime.local_ray run $(SERVE_CONFIG)

# The tests also need Debian's PostgreSQL server binaries (the session starts its own cluster).
test: setup
	$(PYTHON) scripts/install.py --only postgres
	$(BIN)/python -m pytest

unit: setup
	$(BIN)/python -m pytest tests/unit

clean:
	rm -rf $(VENV) $(TOOLS_VENV) .models
