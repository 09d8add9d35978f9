"""Pipeline stages built from torchtitan's MoE, for expert parallelism on CPU/gloo
(``tests/test_expert_parallel.py``, ``benchmarks/coordination_bench.py``).

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

import functools
import importlib.util

import torch
from torch.distributed.tensor import distribute_tensor, Shard

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


def experts_of(block: MoEBlock) -> torch.nn.Module:
    """The module holding the block's routed expert weights (in either torchtitan)."""
    return block.moe.experts if TORCHTITAN_0_2 else block.moe.routed_experts.inner_experts


def shard_experts(block: MoEBlock, ep_mesh) -> MoEBlock:
    """Expert parallelism on the block's routed experts over ``ep_mesh`` (0.2: torchtitan's
    ``ExpertParallel`` style; 0.3: what ``RoutedExperts.parallelize`` does)."""
    if TORCHTITAN_0_2:
        from torch.distributed.tensor.parallel import parallelize_module
        from torchtitan.distributed.expert_parallel import ExpertParallel

        parallelize_module(block.moe.experts, ep_mesh, ExpertParallel())
        return block
    distribute_parameters(experts_of(block), ep_mesh, [Shard(0)])
    block.moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)
    return block


def distribute_parameters(module: torch.nn.Module, mesh, placements) -> None:
    """Replace the module's own parameters by DTensors placed as ``placements`` on ``mesh``."""
    for name, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, torch.nn.Parameter(
            distribute_tensor(p.data, mesh, placements)))


def make_batch(ep: int, n_microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each EP rank its own tokens (so its own routing) and targets."""
    g = torch.Generator().manual_seed(100 + ep)
    n = n_microbatches * BATCH_PER_MICROBATCH
    return torch.randn(n, TOKENS, DIM, generator=g), torch.randn(n, TOKENS, DIM, generator=g)
