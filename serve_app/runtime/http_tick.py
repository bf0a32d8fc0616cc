"""The router's HTTP server wakes once a second while idle, not ten times.

Serve's direct ingress runs a uvicorn ``Server`` on the router replica's event loop, and uvicorn's
``Server.main_loop`` wakes every 0.1 s: to refresh the ``Date`` header (once a second) and to see
whether ``should_exit`` was set. On an idle router those ten wake-ups were half of its event loop's
18 a second (strace of the loop's ``epoll_pwait`` timeouts; docs/benchmarks.md, "The router's idle
event loop"). ``install`` replaces that loop with one that ticks once a second — the header is
refreshed as often as before — and wakes at once when Serve sets ``should_exit`` (its drain closes
the listener that way, then its shutdown waits for the server), so no exit waits for a tick.

In the router's process only (``Router.__init__``), before Serve starts the server: the class is
uvicorn's, and nothing else in that process runs one.
"""

import asyncio

import uvicorn

TICK_S = 1.0
_FLAG, _WAITER = "_serve_app_should_exit", "_serve_app_tick"


class _ExitFlag:
    """``Server.should_exit`` as a data descriptor: setting it true also ends the current tick."""

    def __get__(self, server, owner=None):
        return self if server is None else server.__dict__.get(_FLAG, False)

    def __set__(self, server, value) -> None:
        server.__dict__[_FLAG] = value
        waiter = server.__dict__.get(_WAITER)
        if value and waiter is not None:
            # Serve sets it on the server's loop; from any other thread the wake-up is handed over.
            waiter.get_loop().call_soon_threadsafe(_wake, waiter)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def _main_loop(self: uvicorn.Server) -> None:
    """uvicorn's ``main_loop`` (same ``on_tick`` calls, header refreshed on every one), once a second."""
    loop = asyncio.get_running_loop()
    counter = 0
    should_exit = await self.on_tick(counter)
    while not should_exit:
        counter = (counter + 10) % 864000  # on_tick refreshes the Date header when counter % 10 == 0
        waiter = self.__dict__[_WAITER] = loop.create_future()
        timer = loop.call_later(TICK_S, _wake, waiter)
        try:
            if not self.should_exit:  # set since the last tick read it
                await waiter
        finally:
            timer.cancel()
        should_exit = await self.on_tick(counter)


def install() -> None:
    """Make every uvicorn ``Server`` of this process tick once a second (idempotent)."""
    uvicorn.Server.should_exit = _ExitFlag()
    uvicorn.Server.main_loop = _main_loop
