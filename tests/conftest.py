import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def load_serve_config(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / name).read_text())


def app_args(config: dict) -> dict:
    (application,) = config["applications"]
    return application["args"]
