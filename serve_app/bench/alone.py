"""One side alone on the host: while one side's batch runs (with the quiet before it and after
it), every process of the other server is stopped (SIGSTOP) and continued (SIGCONT) after.

Both servers stay loaded for the whole run (starting ours takes minutes, so rounds could not
take turns otherwise), but an idle server is not free: ours' Ray processes cost 5–15 % of a core
doing nothing (docs/benchmarks.md, "The idle floor"), and that came out of bare vLLM's batches,
which flattered ours. Measured on the 2-core host (2026-12-07, bare vLLM alone at 16 streams,
three runs a condition taking turns): TTFT p50 67–75 ms with ours stopped against 77–95 ms with
ours idle beside it. Stopped, a process uses no CPU and its timers wait; continued, it catches up
in the quiet wait before its own next batch.

A benchmark killed by SIGTERM or SIGHUP, or leaving by an exception, continues what it stopped
first; one killed by SIGKILL cannot: it prints the pids it stops, once, so ``kill -CONT`` can.
"""

import atexit
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from serve_app.bench.cpu import SERVERS, Meter
from serve_app.bench.procs import ProcessTable, Tracked

# Stopped by this process and not continued yet: (table, tracked) pairs, for the exit handlers.
_STOPPED: dict[int, tuple[ProcessTable, Tracked]] = {}
_HANDLED = (signal.SIGTERM, signal.SIGHUP)
_installed = False


class Alone:
    """``Alone(meter).running(side)``: the context in which only ``side``'s server runs."""

    def __init__(self, meter: Meter, say: Callable[[str], None] = print) -> None:
        self.meter, self.say, self._said = meter, say, False

    @contextmanager
    def running(self, side: str) -> Iterator[list[Tracked]]:
        """Stop every process of the servers other than ``side`` (looked for again first: a
        worker born since counts), yield those stopped, continue them whatever happens."""
        meter = self.meter
        meter.refresh()
        others = [t for t in meter.tracked.values() if t.side in SERVERS and t.side != side]
        _install_exit_handlers()
        if others and not self._said:
            self._said = True
            pids = " ".join(str(t.pid) for t in meter.tracked.values() if t.side in SERVERS)
            self.say(f"each side runs alone: the other's processes are stopped during its batches (should "
                     f"this benchmark be killed with SIGKILL: kill -CONT {pids})")
        stopped = []
        try:
            for t in others:
                _STOPPED[t.pid] = (meter.table, t)
                if meter.table.signal(t.pid, t.create_time, signal.SIGSTOP):
                    stopped.append(t)
                else:
                    _STOPPED.pop(t.pid, None)
            yield stopped
        finally:
            for t in others:
                if _STOPPED.pop(t.pid, None) is not None:
                    meter.table.signal(t.pid, t.create_time, signal.SIGCONT)


def continue_all() -> None:
    """Continue every process this benchmark stopped and has not continued yet."""
    while _STOPPED:
        _, (table, t) = _STOPPED.popitem()
        table.signal(t.pid, t.create_time, signal.SIGCONT)


def _install_exit_handlers() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(continue_all)
    for signum in _HANDLED:
        previous = signal.getsignal(signum)

        def handler(number, frame, previous=previous):
            continue_all()
            if previous == signal.SIG_IGN:
                return
            if callable(previous):
                previous(number, frame)
            else:  # the default action (terminate), as if this handler had not been here
                signal.signal(number, signal.SIG_DFL)
                os.kill(os.getpid(), number)

        signal.signal(signum, handler)
