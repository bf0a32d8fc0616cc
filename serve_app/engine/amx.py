"""Linux's permission for AMX tiles, asked for in every vLLM process (a ``vllm.general_plugins``
entry point: vLLM runs it in the API server or replica, the engine core and each worker).

vLLM-CPU's attention picks its AMX kernel wherever the CPU has AMX tiles and the KV cache is
bf16 (``cpu_attn._get_attn_isa``), but never asks Linux for them. A process must ask before its
first tile instruction (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; the kernel's
AMX state is off by default), or that instruction is a SIGILL. oneDNN asks when it chooses AMX
for a matmul, so whether the worker has the permission when attention first runs depended on
which kernels ran before it: on an AMX Xeon the integration session's embedding worker died of
SIGILL in ``cpu_attention_with_kv_cache`` on its first request (2026-12-05), while ``make run``'s
did not. torch's ``_init_amx`` makes the request; elsewhere this does nothing.
"""

import logging

# serve_app.telemetry.logs.module_logger's name, without telemetry's imports in every vLLM process.
logger = logging.getLogger(f"ray.serve.{__name__}")


def request_amx_tiles() -> None:
    """Ask for AMX tiles where the CPU has them (idempotent: vLLM may load plugins twice)."""
    import torch  # vLLM's processes have it loaded already

    if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
        logger.warning("AMX tiles: the kernel refused the permission; vLLM's AMX attention will fail")
