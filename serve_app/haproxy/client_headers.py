"""Serve's per-request controls, which no client may set: Ray's direct ingress reads them off the
request as it reaches the router replica (``_private/replica.py``, ``http_util.py``):

- ``x-request-timeout-seconds``: the request's timeout in place of ``http_options``'; a value of 0
  or less disables it, so a client could run a stream past the 600 s every request is held to
  (and past an old HAProxy's ``hard-stop-after``, runtime/ray_env.py);
- ``x-request-disconnect-disabled: ?1``: the replica stops watching for the client leaving.

The launcher has HAProxy delete both from every request in ``http_frontend``, before routing.
(Names as Ray 2.60's constants; ``tests/unit/test_haproxy_launcher.py`` holds them equal. Not
imported from Ray: the launcher runs at every HAProxy start and reload, and imports no Ray.)
"""

CONTROLS = ("x-request-timeout-seconds", "x-request-disconnect-disabled")
_LINES = [f"    http-request del-header {name}\n" for name in CONTROLS]


def without_client_controls(config: str) -> str:
    """``config`` whose ``http_frontend`` deletes ``CONTROLS`` first thing after its ``bind``
    (as it is: Ray rewrites the whole file for every reload, and a second pass adds nothing)."""
    if _LINES[0] in config:
        return config
    out, section = [], None
    placed = False
    for line in config.splitlines(keepends=True):
        if line.strip() and not line[0].isspace() and not line.startswith("#"):
            section = line.split()[0:2]
        out.append(line)
        if section == ["frontend", "http_frontend"] and not placed and line.split()[:1] == ["bind"]:
            out += _LINES
            placed = True
    return "".join(out)
