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
first; one killed by SIGKILL cannot: it prints the pids it stops, each as it is first stopped, so
``kill -CONT`` can.
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
        self.meter, self.say, self._said = meter, say, set()
        self.refused: dict[int, str] = {}  # pid → label: alive, but not ours to stop (the run says so)

    @contextmanager
    def running(self, side: str) -> Iterator[list[Tracked]]:
        """Stop every process of the servers other than ``side`` (looked for again first: a
        worker born since counts), yield those stopped, continue them whatever happens."""
        meter = self.meter
        meter.refresh()
        others = [t for t in meter.tracked.values() if t.side in SERVERS and t.side != side]
        _install_exit_handlers()
        self._say_pids(others)
        stopped = []
        try:
            with _exit_signals_held():  # no exit handler between a stop and its record
                for t in others:
                    if meter.table.signal(t.pid, t.create_time, signal.SIGSTOP):
                        _STOPPED[t.pid] = (meter.table, t)
                        stopped.append(t)
                    elif meter.table.cpu_seconds(t.pid, t.create_time) is not None and t.pid not in self.refused:
                        self.refused[t.pid] = t.label  # another user's, say: it runs beside the batch
                        self.say(f"warning: could not stop {t.label} [{t.pid}]: it runs beside the other side's "
                                 "batches")
            yield stopped
        finally:
            with _exit_signals_held():
                for t in others:
                    if _STOPPED.pop(t.pid, None) is not None:
                        meter.table.signal(t.pid, t.create_time, signal.SIGCONT)

    def _say_pids(self, others: list[Tracked]) -> None:
        """The pids a SIGKILLed benchmark would leave stopped: once, then each one found since."""
        new = [t.pid for t in others if t.pid not in self._said]
        if not new:
            return
        first = not self._said
        self._said.update(new)
        pids = " ".join(map(str, new))
        self.say(f"each side runs alone: the other's processes are stopped during its batches (should this "
                 f"benchmark be killed with SIGKILL: kill -CONT {pids})" if first else
                 f"each side runs alone: also stopped from now on: {pids}")


@contextmanager
def _exit_signals_held() -> Iterator[None]:
    """SIGTERM and SIGHUP held back (delivered on leaving) where the process may set them."""
    try:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
    except (ValueError, OSError):  # no such call here
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


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
            if previous == signal.SIG_IGN:  # ignored before (nohup): the run goes on, alone as it was
                return
            if callable(previous):  # its own handler: an exception it raises leaves ``running`` continuing
                previous(number, frame)
                return
            continue_all()  # the default action ends the process: nothing stays stopped
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)

        try:
            signal.signal(signum, handler)
        except ValueError:  # not the main thread: atexit and ``running``'s own ``finally`` remain
            pass
