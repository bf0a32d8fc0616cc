"""One GPU, two engines (serve_app/regions/gpu_memory.py): in every region the LLM and the
embedding model share each Blackwell GPU, and the arithmetic — each engine's weights, activation
headroom and KV cache within its gpu_memory_utilization, the budgets within the GPU — holds
against that GPU's memory. Then the region files an operator could write that would not fit."""

import pytest
import yaml

from serve_app import catalog
from serve_app.catalog import GIB
from serve_app.regions import gpu_memory
from serve_app.regions import schema as regions
from tests.conftest import REPO

REGIONS = regions.load_regions(REPO / "regions")
LLM, EMBED = "qwen-3.6-35b-a3b", "qwen-3-embedding-0.6b"


def test_every_blackwell_type_has_its_memory_stated():
    assert set(gpu_memory.GPU_MEMORY_GIB) == set(regions.BLACKWELL_ACCELERATORS)
    assert round(gpu_memory.GPU_MEMORY_GIB["B200"] * GIB / 1e9) == 180
    assert round(gpu_memory.GPU_MEMORY_GIB["RTX-PRO-6000"] * GIB / 1e9) == 96


@pytest.mark.parametrize("region_id", sorted(REGIONS))
def test_the_llm_and_the_embedding_model_share_each_gpu_and_both_fit_its_memory(region_id):
    region = REGIONS[region_id]
    gpu_gib = gpu_memory.GPU_MEMORY_GIB[region.gpu.accelerator_type]
    sharing = {model.id: model for model in gpu_memory.shared(region.models)}
    assert set(sharing) == {LLM, EMBED}
    assert sum(model.gpus for model in sharing.values()) <= 1  # Ray packs one of each on a GPU
    needs = [gpu_memory.need(model, region.gpu.accelerator_type) for model in sharing.values()]
    for model, needed in zip(sharing.values(), needs):
        # Its own budget holds its weights, headroom and KV cache ...
        assert needed.total_gib <= needed.budget_gib, needed.line()
        # ... and the budget is within its share of the GPU, less the reserve.
        assert model.gpu_memory_utilization <= model.gpus - gpu_memory.SHARED_GPU_RESERVE
    # Both engines' budgets, and so everything both need, fit the GPU's memory.
    assert sum(n.total_gib for n in needs) <= sum(n.budget_gib for n in needs) <= gpu_gib
    assert not gpu_memory.problems(region.models, region.gpu.accelerator_type)


def test_the_arithmetic_of_the_rtx_pro_6000_regions_in_numbers():
    llm, embed = (m for m in gpu_memory.shared(REGIONS["yul-02"].models))
    llm_need, embed_need = (gpu_memory.need(m, "RTX-PRO-6000") for m in (llm, embed))
    # LLM: 64 sequences x 8192 tokens x 20 KiB, plus 64 x 61.4 MiB of Gated-DeltaNet state.
    assert llm_need.kv_cache_gib == pytest.approx((64 * 8192 * 20480 + 64 * 64_389_120) / GIB)
    assert llm_need.kv_cache_gib == pytest.approx(13.84, abs=0.01)
    assert llm_need.total_gib == pytest.approx(54.84, abs=0.01) and llm_need.budget_gib == pytest.approx(76.9, abs=0.1)
    # Embeddings: one 16,384-token engine step x 112 KiB.
    assert embed_need.kv_cache_gib == pytest.approx(16384 * 114_688 / GIB) == pytest.approx(1.75)
    assert embed_need.total_gib == pytest.approx(4.45) and embed_need.budget_gib == pytest.approx(7.15, abs=0.01)


def _yul(changes: dict | None = None) -> dict:
    """yul-02's region data with ``{(model id, field): value}`` changed (None: removed)."""
    data = yaml.safe_load((REPO / "regions" / "yul-02.yaml").read_text())
    changes = changes or {}
    for (model_id, field), value in changes.items():
        (model,) = [m for m in data["models"] if m["id"] == model_id]
        if value is None:
            model.pop(field, None)
        else:
            model[field] = value
    return data


@pytest.mark.parametrize("changes, fragment", [
    # The LLM's budget over its share: two budgets past the GPU's memory.
    ({(LLM, "gpu_memory_utilization"): 0.9}, "gpu_memory_utilization 0.9 is over its 0.9 of the GPU less 0.02"),
    # Shares without saying how much memory: vLLM's 0.9 default would leave the other engine nothing.
    ({(EMBED, "gpu_memory_utilization"): None}, "qwen-3-embedding-0.6b shares a GPU: set its gpu_memory_utilization"),
    # Fractions that Ray could never pack onto one GPU together.
    ({(EMBED, "gpus"): 0.2, (EMBED, "gpu_memory_utilization"): 0.15}, "their fractions add up to 1.1"),
    # A budget too small for what its engine needs: 128 full-context sequences of KV cache.
    ({(LLM, "max_num_seqs"): 256, (LLM, "max_ongoing_requests"): 384, (LLM, "target_ongoing_requests"): 24},
     "qwen-3.6-35b-a3b does not fit its share of a RTX-PRO-6000"),
    ({(EMBED, "gpu_memory_utilization"): 0.03}, "qwen-3-embedding-0.6b does not fit its share"),
])
def test_a_shared_gpu_that_would_not_fit_is_refused_naming_the_model_and_the_numbers(changes, fragment):
    with pytest.raises(regions.RegionError) as refused:
        regions.parse_region(_yul(changes), "regions/yul-02.yaml")
    assert fragment in str(refused.value)


def test_a_model_without_memory_facts_cannot_share_a_gpu():
    data = _yul({(LLM, "replicas"): {"min": 1, "max": 3}})
    data["models"].append({"id": "qwen-3.5-27b", "replicas": {"min": 1, "max": 1}, "gpus": 0.5,
                           "gpu_memory_utilization": 0.4})
    assert catalog.get("qwen-3.5-27b").gpu_memory is None
    with pytest.raises(regions.RegionError, match="the catalog states no gpu_memory"):
        regions.parse_region(data)


def test_the_regions_gpus_count_each_replicas_share_and_no_two_large_ones_on_one_gpu():
    # 4 x 0.9 + 2 x 0.1 = 3.8 of 4: fits. 3 more embedding replicas: 4.1.
    with pytest.raises(regions.RegionError, match="add up to 4.1 GPUs but the region has 4"):
        regions.parse_region(_yul({(EMBED, "replicas"): {"min": 1, "max": 5}}))
    # 0.6 of a GPU each: 4 x 0.6 = 2.4 GPUs by the sum, but no two share a GPU: 4 GPUs.
    data = _yul({(LLM, "gpus"): 0.6, (LLM, "gpu_memory_utilization"): 0.55,
                 (EMBED, "gpus"): 0.4, (EMBED, "gpu_memory_utilization"): 0.08})
    data["models"][0]["replicas"] = {"min": 1, "max": 5}
    with pytest.raises(regions.RegionError, match="add up to 5 GPUs but the region has 4"):
        regions.parse_region(data)


def test_a_worker_pod_holds_the_cpus_of_both_engines_on_its_gpu():
    data = _yul()
    data["kubernetes"]["gpu_worker"]["cpus"] = 9  # 8 for the LLM + 2 for the embedding model
    with pytest.raises(regions.RegionError, match=r"less than a model replica needs \(10\)"):
        regions.parse_region(data)


def test_terraform_asks_for_the_whole_gpus_the_shares_add_up_to():
    from serve_app.regions.render import gpus_taken

    region = REGIONS["yul-02"]
    assert (gpus_taken(region, "min"), gpus_taken(region, "max")) == (1, 4)  # 0.9 + 0.1; 3.6 + 0.2
    assert gpus_taken(REGIONS["fra-01"], "max") == 8  # 5 x 0.9 + 3 x 1 + 2 x 0.1 = 7.7
