"""One GPU, two engines: the memory arithmetic of the models a region places on a shared GPU.

A region file gives a model ``gpus`` below 1 to share each GPU with the other fractional models
(the LLM and the embedding model beside it: docs/regions.md, "One GPU, two engines"). Ray packs
the fractions onto one GPU; each engine is a separate vLLM process that takes
``gpu_memory_utilization`` of the GPU's memory for its weights, activations and KV cache, and
refuses to start if that much is not free. So two rules make any packing Ray chooses fit:

- a shared model's ``gpu_memory_utilization`` is at most its ``gpus`` less ``SHARED_GPU_RESERVE``
  (what vLLM's budget cannot see: the other process's CUDA context, the allocator's slack), so
  the budgets of the engines on one GPU add up to less than its memory whatever Ray packs;
- each budget holds what its engine needs (``need``): the weights, the activation headroom, and
  the KV cache its ``max_num_seqs`` needs, from the catalog's facts (``catalog.GpuMemory``).

A generating engine's KV cache must hold every sequence it runs at the served context
(``max_num_seqs`` x ``max_model_len`` tokens, plus each sequence's Gated-DeltaNet state), so it
never preempts a sequence at the cap. A pooling engine finishes each input in its prefill and
frees its blocks: it needs one engine step's tokens (``max_num_batched_tokens``, at least one
input at the served context).

The GPU's memory is the vendor's capacity in decimal GB (``GPU_MEMORY_GIB``), less than what the
driver reports (B200: 180 GB where nvidia-smi shows ~179 GiB), so a budget checked here is at most
what the engine gets. Nothing here imports Ray or vLLM.
"""

from dataclasses import dataclass

from serve_app import catalog
from serve_app.catalog import GIB

# Vendor capacity per GPU: HGX B200 (1,440 GB over 8 GPUs), RTX PRO 6000 Blackwell Server Edition.
GPU_MEMORY_GIB = {"B200": 180e9 / GIB, "RTX-PRO-6000": 96e9 / GIB}
SHARED_GPU_RESERVE = 0.02  # of the GPU, per engine sharing it


@dataclass(frozen=True)
class Need:
    """What one replica of ``model`` needs of a GPU, in GiB, and what its budget gives it."""

    model: str
    weights_gib: float
    headroom_gib: float
    kv_cache_gib: float
    budget_gib: float  # gpu_memory_utilization x the GPU's memory

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.headroom_gib + self.kv_cache_gib

    def line(self) -> str:
        return (
            f"{self.model}: weights {self.weights_gib:.1f} + headroom {self.headroom_gib:.1f} + KV cache "
            f"{self.kv_cache_gib:.1f} = {self.total_gib:.1f} GiB of a {self.budget_gib:.1f} GiB budget"
        )


def need(model, accelerator_type: str) -> Need:
    """``model`` (a ``RegionModel``) as one engine on a GPU of ``accelerator_type``; its catalog
    entry must state its ``gpu_memory``."""
    entry = catalog.get(model.id)
    facts = entry.gpu_memory
    context = entry.engine.max_model_len
    if entry.task == "generate":
        kv_bytes = model.max_num_seqs * (context * facts.kv_bytes_per_token + facts.state_bytes_per_sequence)
    else:
        kv_bytes = max(context, model.max_num_batched_tokens or context) * facts.kv_bytes_per_token
    budget = model.gpu_memory_utilization * GPU_MEMORY_GIB[accelerator_type]
    return Need(model.id, facts.weights_gib, facts.headroom_gib, kv_bytes / GIB, budget)


def shared(models) -> list:
    """The models that share each GPU: those with a fraction of one."""
    return [model for model in models if model.gpus < 1]


def problems(models, accelerator_type: str) -> list[str]:
    """What breaks the rules above for a region's ``models`` on ``accelerator_type`` GPUs."""
    sharing = shared(models)
    if not sharing:
        return []
    found = []
    fractions = sum(model.gpus for model in sharing)
    if len(sharing) > 1 and round(fractions, 6) > 1:
        names = ", ".join(f"{model.id} ({model.gpus:g})" for model in sharing)
        found.append(f"models with a fraction of a GPU share each GPU, but their fractions add up to {fractions:g}: {names}")
    for model in sharing:
        if "gpu_memory_utilization" not in model.model_fields_set:
            found.append(f"{model.id} shares a GPU: set its gpu_memory_utilization (at most {model.gpus - SHARED_GPU_RESERVE:g})")
            continue
        if model.gpu_memory_utilization > round(model.gpus - SHARED_GPU_RESERVE, 6):
            found.append(
                f"{model.id}: gpu_memory_utilization {model.gpu_memory_utilization:g} is over its {model.gpus:g} of "
                f"the GPU less {SHARED_GPU_RESERVE:g} for the other engine's CUDA context"
            )
        if catalog.get(model.id).gpu_memory is None:
            found.append(f"{model.id} cannot share a GPU: the catalog states no gpu_memory for it")
            continue
        if (needs := need(model, accelerator_type)).total_gib > needs.budget_gib:
            found.append(f"{model.id} does not fit its share of a {accelerator_type}: {needs.line()}")
    return found
