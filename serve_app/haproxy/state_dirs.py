"""Remove the HAProxy state directories that Ray leaves behind, one per node per cluster.

Ray 2.60's HAProxyManager keeps each node's HAProxy files (config, admin and metrics sockets,
server state, the 500 page, the last spawns' stdout/stderr) in ``/tmp/haproxy-serve/<node id>/``
(``RAY_SERVE_HAPROXY_CONFIG_FILE_LOC`` and friends, made per node by ``_per_node`` in
``ray/serve/_private/haproxy.py``) and never removes it: every ``make run``, test session or
benchmark adds one, since each Ray start makes new node ids. ``ray stop`` removes no directory
either, and the cluster's session directory is not known when these paths are read, so they
cannot be pointed inside it.

A directory is in use while any process on this host names it: a Ray process of that node (the
raylet and Ray's agents carry ``--node_id=<id>`` / ``--node-id=<id>``; they outlive the node's
HAProxyManager, and exist before it makes the directory) or a process with a path inside it on its
command line (HAProxy's ``-f <dir>/haproxy.cfg``, a worker left over from a crash included).
Anything else with a Ray node id for a name is stale. Nothing is matched by a pattern on names
alone and nothing is killed: only directories no process names are removed.
"""

import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

NODE_ID = re.compile(r"[0-9a-f]{56}")  # a Ray NodeID: 28 bytes, hex


def live_command_lines(proc: Path = Path("/proc")) -> list[list[str]]:
    """Every readable process's argv on this host (Linux ``/proc``; elsewhere none, so nothing
    is ever judged stale)."""
    lines = []
    try:
        pids = [entry for entry in os.listdir(proc) if entry.isdigit()]
    except OSError:
        return []
    for pid in pids:
        try:
            raw = (proc / pid / "cmdline").read_bytes()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if raw:
            lines.append(raw.decode("utf-8", "replace").rstrip("\0").split("\0"))
    return lines


def is_in_use(directory: Path, command_lines: Iterable[list[str]]) -> bool:
    node_flags = {f"--node_id={directory.name}", f"--node-id={directory.name}"}
    inside = str(directory) + os.sep
    for argv in command_lines:
        for arg in argv:
            if arg in node_flags or arg == str(directory) or inside in arg:
                return True
    return False


def stale_state_dirs(base: Path, keep: Path, command_lines: Iterable[list[str]]) -> list[Path]:
    """Per-node directories under ``base`` that no process names, ``keep`` (the caller's own)
    aside. Only real directories named like a Ray node id: never a link, never anything else
    someone put under ``base``."""
    command_lines = list(command_lines)
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return []
    return [
        entry
        for entry in entries
        if NODE_ID.fullmatch(entry.name)
        and entry != keep
        and entry.is_dir()
        and not entry.is_symlink()
        and not is_in_use(entry, command_lines)
    ]


def sweep_stale_state_dirs(own: Path, command_lines: Iterable[list[str]] | None = None) -> list[Path]:
    """Remove the stale siblings of ``own`` (this node's state directory); the ones removed. Does
    nothing unless ``own`` itself is a per-node directory (Ray's layout). A directory that cannot
    be removed (another user's) is left."""
    own = Path(own)
    if not NODE_ID.fullmatch(own.name):
        return []
    lines = live_command_lines() if command_lines is None else command_lines
    removed = []
    for directory in stale_state_dirs(own.parent, own, lines):
        try:
            shutil.rmtree(directory)
        except OSError:
            continue
        removed.append(directory)
    return removed
