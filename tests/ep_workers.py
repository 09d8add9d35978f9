"""Rank functions for tests/test_expert_parallel.py: PP 2 x EP 2 with torchtitan's MoE.

Every stage is a residual MoE block built from torchtitan's own MoE module, its experts
sharded over the EP group as torchtitan's expert parallelism does (``Shard(0)`` DTensors
on the EP mesh; tokens dispatched and combined by all-to-all with uneven splits). Each EP
rank gets its own data, so the splits differ between ranks and microbatches. Both
torchtitan versions, each through its own MoE:

* 0.2 (torch 2.13 venv): ``torchtitan.models.moe.MoE`` with for-loop experts, sharded by
  torchtitan's ``ExpertParallel`` style (``all_to_all_single_autograd``). It needs two
  fixes on CPU, applied per test process by ``use_cpu_moe_paths`` (torchtitan_ext's CPU
  support carries the product's own): CPU ``torch.histc`` has no integer kernel (the
  router counts tokens per expert on int64 expert ids), and the token permutation after
  the dispatch must take its CPU path (``generate_permute_indices(..., use_cpu=True)``)
  instead of a Triton kernel.
* 0.3 (torch 2.14 venv): ``torchtitan.models.common.moe.MoE`` (grouped-mm experts) with
  its ``AllToAllTokenDispatcher``; the expert weights are distributed ``Shard(0)`` on the
  EP mesh and the dispatcher wired to it, as its ``RoutedExperts.parallelize`` does from a
  full ``ParallelDims``. Its default SPMD backend's list all-to-all is refused by gloo
  for uneven sizes, so ``use_cpu_moe_paths`` selects the ``partial_dtensor`` backend.
"""

from __future__ import annotations

import copy
import functools
import importlib.util

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import distribute_tensor, Shard

from rrfp import ScheduleRRFP
from tests.workers import (coordinated_runs, loss_fn, random_device_time, run_steps,
                           torch_schedule)

TORCHTITAN_0_2 = importlib.util.find_spec("torchtitan.models.moe") is not None
"""Whether the installed torchtitan has 0.2's MoE module (else 0.3's)."""

DIM, TOKENS, BATCH_PER_MICROBATCH = 8, 4, 2
EXPERTS, TOP_K = 4, 2


def use_cpu_moe_paths() -> None:
    """Let torchtitan's MoE run on CPU/gloo in this process (see the module docstring).

    0.2: ``torch.histc`` is wrapped only for integer inputs, which CPU refuses outright:
    they are counted as floats and returned as int64, as CUDA's kernel returns them;
    every other call is torch's own. The permutation fix rebinds the one name
    ``torchtitan.models.moe.utils._permute`` looks up.
    """
    if not TORCHTITAN_0_2:
        from torchtitan.distributed.utils import set_spmd_backend

        set_spmd_backend("partial_dtensor")
        return
    import torchtitan.models.moe.utils as moe_utils

    if not getattr(torch.histc, "_counts_integers_on_cpu", False):
        histc = torch.histc

        @functools.wraps(histc)
        def counting_histc(input, *args, **kwargs):
            if input.is_floating_point() or input.device.type != "cpu":
                return histc(input, *args, **kwargs)
            return histc(input.float(), *args, **kwargs).to(torch.int64)

        counting_histc._counts_integers_on_cpu = True
        torch.histc = counting_histc
    permute = moe_utils.generate_permute_indices
    if not isinstance(permute, functools.partial):
        moe_utils.generate_permute_indices = functools.partial(permute, use_cpu=True)


class MoEBlock(torch.nn.Module):
    """``x + moe(x)`` on ``(batch, tokens, dim)``: a transformer block's MoE half."""

    def __init__(self, moe: torch.nn.Module):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(x)


def make_moe_block(seed: int) -> MoEBlock:
    """torchtitan's MoE: 4 experts, top-2 softmax routing (0.2: with one shared expert)."""
    torch.manual_seed(seed)
    if TORCHTITAN_0_2:
        from torchtitan.models.moe.moe import MoE, MoEArgs

        args = MoEArgs(num_experts=EXPERTS, num_shared_experts=1, top_k=TOP_K,
                       score_func="softmax", use_grouped_mm=False, load_balance_coeff=None)
        moe = MoE(args, dim=DIM, hidden_dim=2 * DIM)
        with torch.no_grad():
            moe.init_weights(0.5, torch.device("cpu"))
        return MoEBlock(moe)
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import (GroupedExperts, MoE, RoutedExperts,
                                              TokenChoiceTopKRouter)
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    config = MoE.Config(
        num_experts=EXPERTS, load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=DIM, hidden_dim=2 * DIM, num_experts=EXPERTS),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOP_K)),
        router=TokenChoiceTopKRouter.Config(
            num_experts=EXPERTS, gate=Linear.Config(in_features=DIM, out_features=EXPERTS),
            top_k=TOP_K, score_func="softmax"))
    moe = config.build()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.1)
    return MoEBlock(moe)


def _experts(block: MoEBlock) -> torch.nn.Module:
    return block.moe.experts if TORCHTITAN_0_2 else block.moe.routed_experts.inner_experts


def shard_experts(block: MoEBlock, ep_mesh) -> MoEBlock:
    """Expert parallelism on the block's routed experts over ``ep_mesh`` (0.2: torchtitan's
    ``ExpertParallel`` style; 0.3: what ``RoutedExperts.parallelize`` does)."""
    if TORCHTITAN_0_2:
        from torch.distributed.tensor.parallel import parallelize_module
        from torchtitan.distributed.expert_parallel import ExpertParallel

        parallelize_module(block.moe.experts, ep_mesh, ExpertParallel())
        return block
    _distribute(_experts(block), ep_mesh, [Shard(0)])
    block.moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)
    return block


def _distribute(module: torch.nn.Module, mesh, placements) -> None:
    for name, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, torch.nn.Parameter(
            distribute_tensor(p.data, mesh, placements)))


def make_batch(ep: int, n_microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each EP rank its own tokens (so its own routing) and targets."""
    g = torch.Generator().manual_seed(100 + ep)
    n = n_microbatches * BATCH_PER_MICROBATCH
    return torch.randn(n, TOKENS, DIM, generator=g), torch.randn(n, TOKENS, DIM, generator=g)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    use_cpu_moe_paths()
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))


def _local_grads(history):
    return [([g.to_local() if hasattr(g, "to_local") else g for g in grads], losses)
            for grads, losses in history]


def expert_parallel(rank: int, world_size: int, coordination: str, hint: str,
                    delay_seeds: tuple[int, ...]) -> dict:
    """RRFP vs torch's fixed ``hint`` on the same MoE stages and data, in one run: the
    fixed schedule first, then RRFP without delays and with random delays per rank
    (stage compute and messages), which reorder actions."""
    mesh = _mesh()
    pp, ep = mesh["pp"].get_local_rank(), mesh["ep"].get_local_rank()
    per_rank = 2 if hint == "Interleaved1F1B" else 1
    num_stages, M, steps = 2 * per_rank, 4, 2
    chain = [make_moe_block(seed=s) for s in range(num_stages)]
    local = [pp + 2 * k for k in range(per_rank)]
    x, y = make_batch(ep, M)

    def build(seed: int | None):
        blocks, stages = [], []
        for s in local:
            block = shard_experts(copy.deepcopy(chain[s]), mesh["ep"])
            module = block if seed is None else random_device_time(seed * 10 + ep, s, M, 0.003)(block)
            blocks.append(block)
            stages.append(PipelineStage(module, s, num_stages, torch.device("cpu"),
                                        group=mesh["pp"].get_group()))
        return stages, blocks

    stages, blocks = build(None)
    fixed = _local_grads(run_steps(torch_schedule(hint, stages, M), stages, blocks, x, y, steps))
    runs = coordinated_runs(rank, build, _local_grads, fixed, hint, M, mesh["ep"].get_group(),
                            coordination, delay_seeds, x, y, steps)
    return {"pp": pp, "ep": ep, "runs": runs,
            "sharded": [n for b in blocks for n, p in b.named_parameters() if hasattr(p, "to_local")]}


def uncoordinated_expert_parallel(rank: int, world_size: int, case: str) -> dict:
    """PP 2 x EP 2 that RRFP must refuse at its first step, before any all-to-all:
    ``"none"``: MoE stages, no coordination group; ``"pp_group"``: a coordination group
    that does not cover the EP ranks (the PP group); ``"dense_last"``: MoE on pipeline
    rank 0 only, the last stage a dense block that shards nothing, no coordination group
    (pipeline rank 1's ranks must refuse as well, not wait for their peers)."""
    mesh = _mesh()
    pp, ep = mesh["pp"].get_local_rank(), mesh["ep"].get_local_rank()
    dense = case == "dense_last" and pp == 1
    block = (torch.nn.Sequential(torch.nn.Linear(DIM, DIM)) if dense
             else shard_experts(make_moe_block(seed=pp), mesh["ep"]))
    dispatches = []
    if not dense:
        _experts(block).register_forward_pre_hook(lambda *_: dispatches.append(1))
    group = mesh["pp"].get_group() if case == "pp_group" else None
    stage = PipelineStage(block, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleRRFP(stage, 2, loss_fn=loss_fn, hint="1F1B", stall_timeout=30,
                            coordination_group=group)
    x, y = make_batch(ep, 2)
    try:
        run_steps(schedule, [stage], [block], x, y, 1)
    except ValueError as e:
        return {"error": str(e), "dispatches": len(dispatches), "dense": dense}
    raise AssertionError("no ValueError")


def expert_tensor_parallel_detected(rank: int, world_size: int) -> dict:
    """Expert weights sharded over a 2 x 2 (ep, etp) mesh as torchtitan's EP x TP shards
    them (``Shard(0)`` over EP, the hidden dimension over TP; 0.2: its
    ``ExpertTensorParallel`` style): which ranks RRFP's check says they are sharded over,
    and whether a group of the EP ranks alone, or of all four, covers them."""
    from torch.distributed.device_mesh import init_device_mesh

    from rrfp.coordination import uncovered_sharded_parameter

    use_cpu_moe_paths()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "etp"))
    block = make_moe_block(seed=0)
    if TORCHTITAN_0_2:
        from torch.distributed.tensor.parallel import parallelize_module
        from torchtitan.distributed.expert_parallel import ExpertTensorParallel

        parallelize_module(block.moe.experts, mesh, ExpertTensorParallel())
    else:
        _distribute(_experts(block), mesh, [Shard(0), Shard(1)])
    ep_ranks = set(dist.get_process_group_ranks(mesh["ep"].get_group()))
    return {"ep_only": uncovered_sharded_parameter(block.named_parameters(), ep_ranks),
            "all": uncovered_sharded_parameter(block.named_parameters(), set(range(4)))}
