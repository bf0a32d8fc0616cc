"""Pin the binds of HAProxy's stats page and Prometheus exporter, in the config Ray renders.

Ray 2.60's template (``ray/serve/_private/haproxy_templates.py``) renders them as::

    frontend prometheus
        bind :9101
    ...
    listen stats
      bind *:8404

that is, on every interface, whatever ``http_options.host`` says. This rewrites a wildcard bind
inside exactly those two sections to ``<host>:<port>``; a bind that already names an address, and
every other section (the HTTP frontend, the backends), is left as Ray wrote it.
"""

import ipaddress
import os
import re

STATS_HOST_ENV = "SERVE_APP_HAPROXY_STATS_HOST"
METRICS_HOST_ENV = "SERVE_APP_HAPROXY_METRICS_HOST"
LOOPBACK = "127.0.0.1"
# Ray's section names for the two listeners, and the variable that names each one's address.
SECTIONS = {"listen stats": STATS_HOST_ENV, "frontend prometheus": METRICS_HOST_ENV}

_BIND = re.compile(r"^(?P<lead>\s+bind\s+)(?P<host>\*|0\.0\.0\.0|::|\[::\])?:(?P<port>\d+)(?P<rest>(\s.*)?)$")


def admin_hosts(environ=os.environ) -> dict[str, str]:
    """Section → the address its bind takes: loopback unless the section's variable names an IP
    literal. ValueError naming the variable for anything else (a host name, a typo): HAProxy then
    does not start, rather than start on every interface."""
    hosts = {}
    for section, name in SECTIONS.items():
        value = environ.get(name, "").strip() or LOOPBACK
        try:
            address = ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an IP address (the stats and metrics binds take one)") from None
        hosts[section] = f"[{address}]" if address.version == 6 else str(address)
    return hosts


def pin_admin_binds(config: str, hosts: dict[str, str]) -> tuple[str, list[str]]:
    """``config`` with each wildcard bind of the ``hosts`` sections on that section's address, and
    the sections that had none to pin (absent, or already specific: a Ray upgrade that moved them
    shows up here, and in tests/unit/test_haproxy_launcher.py)."""
    out, section, pinned = [], None, set()
    for line in config.splitlines(keepends=True):
        if line.strip() and not line[0].isspace() and not line.startswith("#"):
            section = " ".join(line.split())
        match = _BIND.match(line.rstrip("\n")) if section in hosts else None
        if match:
            newline = "\n" if line.endswith("\n") else ""
            line = f"{match['lead']}{hosts[section]}:{match['port']}{match['rest']}{newline}"
            pinned.add(section)
        out.append(line)
    return "".join(out), [section for section in hosts if section not in pinned]
