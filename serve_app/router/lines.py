"""The router's direct lines to model replicas (``wire/line.py``), for a region whose
``router.handle_transport`` is ``direct`` (the default).

A replica's line is learnt from the heads of calls that went through Serve's handle (each names
its replica's ``DirectLine``). A later call goes on that line, on a connection kept open for the
next call, when there is no routing decision to make: **the model has one running replica and
none stopping** (the router's view of Serve's status, ``hot_load/tracker.py``, read at once while
a model is unsettled), and the call does not resume a stream (which names a replica to avoid). With two replicas or more, every call goes through the
handle, whose request router places it by prefix affinity and session (``routing/``): a
replica's prefix cache is worth more than the handle's ~3 ms.

The line named most recently is used; one no head has named for ``STALE_S`` is dropped, so the
next call goes through the handle and learns the line again (a replaced replica has a new one).
A call the line does not start (the replica cannot be reached, closed the line, or answers
``Refused``: full, or stopping) goes through the handle instead: nothing has started, so nothing
is lost or run twice; the line is forgotten unless the replica was only full.
"""

import asyncio
import socket
import time
from dataclasses import dataclass, field

from serve_app.routing import decisions
from serve_app.wire import handoff
from serve_app.wire import line as wire_line
from serve_app.wire import socket as wire_socket
from serve_app.wire.messages import Answer, Call, DirectLine, Refused

STALE_S = 60.0  # a line no head has named for this long is dropped (the next call re-learns it)
IDLE_PER_LINE = 32  # connections kept open per line for the next calls
# A call written to a TCP line whose replica's node vanished (no FIN, no RST) stays unacknowledged:
# TCP keepalive does not apply then, only retransmission (~15 min). Past this, the line's socket fails.
USER_TIMEOUT_MS = 25_000


class LineUnavailable(Exception):
    """The call did not start on the line: send it through the handle. ``unreachable``: the
    replica could not be reached (gone, or going), not a refusal of a replica that is there."""

    def __init__(self, message: str, *, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class _Line:
    line: DirectLine
    seen: float  # when a head last named it
    in_flight: int = 0  # this router's calls on it
    idle: list[Connection] = field(default_factory=list)
    forgotten: bool = False  # no longer in the table: its calls under way keep no connection

    async def connection(self) -> Connection:
        """An open connection to the replica's line: a kept one, or a new one."""
        while self.idle:
            reader, writer = self.idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        line = self.line
        if line.local is not None and line.node is not None and line.node == handoff.this_node():
            sock = await asyncio.wait_for(handoff.connect(line.local), wire_socket.CONNECT_TIMEOUT_S)
            try:
                handoff.present(sock.fileno(), line.key, "S", 0, None)
            except BaseException:
                sock.close()
                raise
            reader, writer = await handoff.open_streams(sock)
        else:
            reader, writer = await wire_socket.connect(line.address, line.key, tls=line.tls)
            sock = writer.get_extra_info("socket")
            if sock is not None and hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
        try:
            ready = await asyncio.wait_for(reader.readexactly(1), wire_socket.CONNECT_TIMEOUT_S)
        except BaseException:
            writer.close()
            raise
        if ready != wire_line.READY:
            writer.close()
            raise ConnectionError("the replica did not take the line")
        return reader, writer

    def keep(self, connection: Connection) -> None:
        if not self.forgotten and len(self.idle) < IDLE_PER_LINE and not connection[1].is_closing():
            self.idle.append(connection)
        else:
            connection[1].close()

    def close(self) -> None:
        self.forgotten = True
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


class Lines:
    """Every replica line this router knows, per model."""

    def __init__(self, clock=time.monotonic):
        self._by_model: dict[str, dict[str, _Line]] = {}
        self._clock = clock

    def learn(self, model: str, line: DirectLine) -> None:
        """A head named ``line``: it serves ``model``."""
        known = self._by_model.setdefault(model, {})
        entry = known.get(line.key)  # a replica's key is its own for its life
        if entry is None:
            known[line.key] = _Line(line, self._clock())
        else:
            entry.seen = self._clock()

    def forget(self, model: str, key: str) -> None:
        """Send ``model``'s calls no more to the line of ``key`` (until a head names it again)."""
        entry = self._by_model.get(model, {}).pop(key, None)
        if entry is not None:
            entry.close()

    def known(self, model: str) -> list[DirectLine]:
        return [entry.line for entry in self._by_model.get(model, {}).values()]

    def call(self, model: str, method: str, call: Call, *, replicas: int) -> "LineCall | None":
        """``call`` on ``model``'s line, or None: it goes through the handle (see the module).
        ``replicas``: the model's running replicas."""
        if replicas != 1 or call.resume is not None or call.avoid_replica is not None:
            return None
        known = self._by_model.get(model)
        if not known:
            return None
        now = self._clock()
        for key in [key for key, entry in known.items() if now - entry.seen > STALE_S]:
            self.forget(model, key)
        if not known:
            return None
        newest = max(known.values(), key=lambda entry: entry.seen)
        if newest.in_flight >= newest.line.capacity:  # this router's calls alone fill it: Serve queues
            return None
        return LineCall(self, model, newest, method, call)

    def close(self) -> None:
        for known in self._by_model.values():
            for entry in known.values():
                entry.close()
        self._by_model.clear()


class LineCall:
    """One call on a line: its items, read as a handle call's are (``ReplicaCall``)."""

    def __init__(self, lines: Lines, model: str, entry: _Line, method: str, call: Call):
        self._lines, self._model, self._entry = lines, model, entry
        self._request = (method, call)
        self._connection: Connection | None = None
        self._frames = wire_socket.KeptRead()  # a frame half read when the client left is read whole
        self._done = False
        entry.in_flight += 1

    @property
    def replica(self) -> str:
        return self._entry.line.replica

    def forget_line(self) -> None:
        self._lines.forget(self._model, self._entry.line.key)

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        if self._connection is None:
            return await self._first()
        try:
            item = await self._frames.next(wire_line.read_frame, self._connection[0])
        except asyncio.CancelledError:
            raise  # the frame's read goes on: the next wait for it (``ReplicaCall.last``) takes it
        except Exception as err:  # closed, reset, or not a frame: the replica is gone
            self._end(keep=False)
            raise ConnectionError(f"the direct line to replica {self.replica} closed mid-call") from err
        if wire_line.is_last(item):
            self._end(keep=True)
        return item

    async def _first(self):
        """The call's head; LineUnavailable when the call did not start on the line (nothing of it
        reached the client or the bill: a replica that had begun it aborts it as the line closes)."""
        try:
            self._connection = await self._entry.connection()
            self._connection[1].write(wire_line.frame(self._request))
            item = await self._frames.next(wire_line.read_frame, self._connection[0])
        except asyncio.CancelledError:
            raise  # the client left: ``ReplicaCall`` cancels the call
        except Exception as err:  # unreachable, closed, TLS it cannot verify, a frame it cannot read
            self._end(keep=False)
            self.forget_line()
            raise LineUnavailable(f"replica {self.replica} not reachable on its line: {err!r}",
                                  unreachable=True) from None
        if isinstance(item, Refused):
            self._end(keep=True)
            if item.reason != "full":
                self.forget_line()
            raise LineUnavailable(f"replica {self.replica} refused the call: {item.reason}")
        if isinstance(item, Answer):
            self._end(keep=True)
        # The request's span and timing name how its replica was chosen, as the request router's do.
        decisions.publish(self._request[1].request_id, decisions.Decision("only_replica", self.replica, 0, 0,
                                                                          policy="direct_line"))
        return item

    def cancel(self) -> None:
        """Give up on the call: closing the connection is the replica's cue to stop it."""
        self._end(keep=False)

    def _end(self, *, keep: bool) -> None:
        if self._done:
            return
        self._done = True
        self._entry.in_flight -= 1
        self._frames.cancel()  # a read under way when the call was given up
        if self._connection is not None:
            if keep:
                self._entry.keep(self._connection)
            else:
                self._connection[1].close()
