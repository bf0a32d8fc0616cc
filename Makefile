# The README's two commands: `make run` (set up, then serve the embedded CPU default on
# 127.0.0.1:8000) and `make test` (set up, then run the whole test suite).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run test unit clean

setup: $(VENV)/.installed

# Re-run the installer whenever the dependencies or the installer change.
$(VENV)/.installed: pyproject.toml scripts/install.py serve_app/tiny_model.py
	$(PYTHON) scripts/install.py --venv $(VENV)
	touch $@

run: setup
	$(BIN)/serve run configs/local.yaml

test: setup
	$(BIN)/python -m pytest

unit: setup
	$(BIN)/python -m pytest tests/unit

clean:
	rm -rf $(VENV) .models
