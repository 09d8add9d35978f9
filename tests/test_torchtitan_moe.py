"""torchtitan with expert parallelism: the MoE CPU support, the coordination group, and the
MoE job (deepseek_v3 debugmodel, PP 2 x EP 2 on 4 processes) trained under RRFP and under
torch's fixed schedule, compared parameter by parameter, bitwise, against whichever
torchtitan is installed (0.2.2: ``train_configs/deepseek_v3_ep_cpu.toml``, 0.3:
``rrfp_deepseek_v3_ep_cpu``)."""

from __future__ import annotations

import importlib
import inspect
import shutil

import pytest
import torch

from tests.titan_helpers import check, failure_excerpt, four_ranks, only_0_2, parse, run_titan, VERSION
from torchtitan_ext.common.cpu import histc, MOE_CPU_PATCHES, moe_cpu_path, TorchWithIntegerHistc
from torchtitan_ext.common.schedules import connected_groups

MOE_SOURCES = {
    (0, 2): ["torchtitan.models.moe.moe", "torchtitan.models.moe.utils"],
    (0, 3): ["torchtitan.models.common.moe", "torchtitan.models.common.token_dispatcher"],
}
"""Per torchtitan version, the modules with its MoE layers' token counting and permutation."""


def test_the_moe_cpu_patch_targets_are_what_torchtitan_calls():
    """0.2.2 counts tokens per expert with ``torch.histc`` on int64 indices (no CPU
    kernel) and permutes with a Triton kernel unless told ``use_cpu=True``: what
    ``MOE_CPU_PATCHES`` replaces. 0.3 does neither, so nothing is replaced; this fails
    when either changes."""
    sources = "".join(inspect.getsource(importlib.import_module(name))
                      for name in MOE_SOURCES[VERSION])
    patched = MOE_CPU_PATCHES[VERSION]
    replaced = set(patched.values())
    assert ("torch.histc(" in sources) == ("torch" in replaced)
    assert ("generate_permute_indices(" in sources) == ("generate_permute_indices" in replaced)
    for name, attribute in patched.items():
        module = importlib.import_module(name)
        current = getattr(module, attribute)
        if attribute == "torch":  # (replaced already if torchtitan_ext.register was imported)
            assert current is torch or isinstance(current, TorchWithIntegerHistc), name
        else:
            assert "use_cpu" in inspect.signature(current).parameters, (name, attribute)


def test_integer_histc_counts_as_cuda_does():
    experts = torch.tensor([[0, 3], [3, 7], [7, 7]])
    counts = histc(experts.view(-1), bins=8, min=0, max=8)
    assert counts.dtype == torch.int64
    assert counts.tolist() == torch.bincount(experts.view(-1), minlength=8).tolist()
    with pytest.raises(RuntimeError, match="Long"):  # what it stands in for
        torch.histc(experts.view(-1), bins=8, min=0, max=8)
    floats = torch.tensor([0.5, 1.5, 1.5])
    assert torch.equal(histc(floats, bins=2, min=0, max=2), torch.histc(floats, 2, 0, 2))


@only_0_2
def test_the_0_2_moe_layers_see_the_cpu_paths():
    from torchtitan.models.moe import kernels, moe, utils

    patched_torch = moe_cpu_path(moe, "torch")
    assert patched_torch.histc is histc and patched_torch.argsort is torch.argsort
    permute = moe_cpu_path(utils, "generate_permute_indices")
    assert permute.func is kernels.generate_permute_indices
    assert permute.keywords == {"use_cpu": True}
    tokens = torch.tensor([3, 0, 2, 1], dtype=torch.int32)  # 2 ranks x 2 local experts
    indices, sizes, _ = permute(tokens, 2, 2, 32, 8)
    assert sizes.tolist() == [8, 8]
    assert sorted(i for i in indices.tolist() if i >= 0) == list(range(6))


def test_ranks_sharing_a_group_directly_or_through_others_are_coordinated_together():
    tp = [{0, 1}, {0, 1}, {2, 3}, {2, 3}]
    assert connected_groups(tp) == [(0, 1), (2, 3)]
    ep_across_tp = [{0, 1, 2}, {0, 1, 3}, {0, 2, 3}, {1, 2, 3}]  # TP {0,1},{2,3}; EP {0,2},{1,3}
    assert connected_groups(ep_across_tp) == [(0, 1, 2, 3)]
    assert connected_groups([{0}, {1}, {2, 3}, {2, 3}]) == [(0,), (1,), (2, 3)]


def coordination_groups_of_meshes(rank: int, world_size: int) -> list[list[int] | None]:
    """``coordination_group``'s ranks for stages whose parameters are DTensors on a
    ("fsdp", "tp") mesh (TP {0,1}, {2,3}), then also on an ("ep", "etp") mesh (EP {0,2},
    {1,3}), then on no intra-stage dimension."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from torchtitan_ext.common.schedules import coordination_group

    dense = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "etp"))

    def stage(*meshes):
        module = torch.nn.Module()
        for i, mesh in enumerate(meshes):
            local = torch.zeros(2, 2)
            module.register_parameter(f"p{i}", torch.nn.Parameter(DTensor.from_local(
                local, mesh, [Shard(0)] * mesh.ndim, run_check=False)))
        return SimpleNamespace(submod=module)

    groups = [coordination_group([stage(dense)]),
              coordination_group([stage(dense), stage(dense, sparse["ep"])]),
              coordination_group([stage(dense["fsdp"])])]
    return [None if g is None else dist.get_process_group_ranks(g) for g in groups]


def test_the_coordination_group_spans_the_tp_and_ep_groups_of_the_stages():
    from rrfp.testing.worlds import run_local_world

    ranks = run_local_world(4, coordination_groups_of_meshes, timeout=120)
    assert [r[0] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(r[1] == [0, 1, 2, 3] for r in ranks)
    assert all(r[2] is None for r in ranks)


def checkpoint_parameters(dump) -> dict[str, torch.Tensor]:
    """The model's parameters as torchtitan checkpointed them at the last step (every
    rank's shards, experts included), read back in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (step,) = (dump / "checkpoint").iterdir()
    dcp_to_torch_save(str(step), str(dump / "parameters.pt"))
    return torch.load(dump / "parameters.pt", weights_only=False)


@four_ranks
def test_the_moe_job_trains_bitwise_as_the_fixed_schedule(tmp_path):
    """PP 2 x EP 2 (FSDP 2 on the dense layers), 2 steps; RRFP with memory to reorder
    (``hint+1``) and its EP groups coordinated: after training every parameter equals the
    fixed Interleaved1F1B's, bitwise (torchtitan's checkpoint of the last step)."""
    steps = 2
    parameters = {}
    for schedule in ("Interleaved1F1B", "RRFP-Interleaved1F1B"):
        dump = tmp_path / schedule
        code, out = run_titan(4, "--training.steps", str(steps), "--rrfp.buffer_limit", "hint+1",
                              "--parallelism.pipeline_parallel_schedule", schedule,
                              "--checkpoint.enable", "--checkpoint.interval", str(steps),
                              dump=str(dump), job="moe", timeout=400)
        assert code == 0, f"{schedule}: {failure_excerpt(out)}"
        assert ("ScheduleRRFP with hint Interleaved1F1B" in out) == schedule.startswith("RRFP")
        parameters[schedule] = checkpoint_parameters(dump)
        shutil.rmtree(dump)  # a checkpoint with its optimizer state: 250 MB
    fixed, rrfp = parameters["Interleaved1F1B"], parameters["RRFP-Interleaved1F1B"]
    assert any("experts" in name for name in fixed)
    assert sorted(fixed) == sorted(rrfp)
    differ = [name for name in fixed if not torch.equal(fixed[name], rrfp[name])]
    assert not differ, differ


@pytest.mark.parametrize("job", ["moe", "moe_16b"])
def test_the_moe_jobs_pass_validation_with_the_same_parallelism_in_both_versions(job):
    """The CPU job and the GPU starting point (not run): their TOML (0.2.2) and config
    function (0.3) give the same pipeline and expert parallelism, and RRFP accepts it."""
    config = parse(job=job)
    check(config)
    parallelism = config.parallelism
    expected = {"moe": (2, 2, 2, 4), "moe_16b": (2, 8, -1, 8)}[job]
    assert (parallelism.pipeline_parallel_degree, parallelism.expert_parallel_degree,
            parallelism.data_parallel_shard_degree, config.training.local_batch_size) == expected
    assert parallelism.pipeline_parallel_schedule == "RRFP"
