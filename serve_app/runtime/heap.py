"""A serving process's start-up heap, out of the garbage collector's reach.

What a router or model replica builds while it starts (FastAPI and pydantic models, Ray's, vLLM's
and our modules, the engine's state) lives as long as the process. Left in the collector's
generations, every full collection under load walks it again; ``gc.freeze()`` moves it to the
permanent generation once, as vLLM's own API server does after its start. Once per process: a
second freeze would also pin what the first left collectable.
"""

import gc

_frozen = False


def freeze_startup() -> None:
    """Collect what start-up left as garbage, then freeze the rest (the first call only)."""
    global _frozen
    if _frozen:
        return
    _frozen = True
    gc.collect()
    gc.freeze()
