import socket
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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
