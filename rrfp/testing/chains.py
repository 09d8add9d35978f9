"""Toy stage chains: small float64 blocks, one per stage, built into PipelineStages, run for
a few optimizer steps under any schedule, and compared bitwise with another run."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import get_schedule_class, PipelineScheduleSingle

from rrfp.core.settings import Settings
from rrfp.testing.study import Study, StudySchedule
from rrfp.testing.timing import random_send_delay, SECOND_ACTIVATION_LATE


DIM = 8
"""Features of every block's input and output."""
BATCH_PER_MICROBATCH = 2
loss_fn = torch.nn.functional.mse_loss


class MLPBlock(torch.nn.Module):
    """Linear up, tanh, linear down: the column-/row-parallel pair of a TP transformer."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(DIM, 2 * DIM)
        self.down = torch.nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def make_chain(num_stages: int, seed: int = 0) -> list[torch.nn.Module]:
    """One small float64 block per stage; the whole model is their composition."""
    torch.manual_seed(seed)
    return [
        torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh()).double()
        for _ in range(num_stages)
    ]


def make_batch(n_microbatches: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for ``n_microbatches`` microbatches (float64)."""
    g = torch.Generator().manual_seed(seed)
    n = n_microbatches * BATCH_PER_MICROBATCH
    return (torch.randn(n, DIM, generator=g, dtype=torch.float64),
            torch.randn(n, DIM, generator=g, dtype=torch.float64))


def local_stage_indices(rank: int, num_ranks: int, num_stages: int, layout: str) -> list[int]:
    """The stages ``rank`` holds under ``layout`` (``"loop"`` or ``"v"``), in stage order."""
    mapping = generate_stage_to_rank_mapping(num_ranks, num_stages, style=layout)
    return [s for s in range(num_stages) if mapping[s] == rank]


def build_stages(chain, rank, num_ranks, layout, wrap: Callable | None = None):
    """Fresh copies of this rank's blocks as PipelineStages (and the blocks themselves)."""
    indices = local_stage_indices(rank, num_ranks, len(chain), layout)
    blocks = [copy.deepcopy(chain[s]) for s in indices]
    modules = [wrap(s, b) if wrap else b for s, b in zip(indices, blocks)]
    stages = [PipelineStage(m, s, len(chain), torch.device("cpu")) for m, s in zip(modules, indices)]
    return stages, blocks


def torch_schedule(name: str, stages, n_microbatches: int, **kwargs):
    """torch's schedule class ``name`` over ``stages`` (its first, if single-stage), mse loss."""
    cls = get_schedule_class(name)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, **kwargs)
    return cls(stages, n_microbatches, loss_fn=loss_fn, **kwargs)


def run_steps(schedule, stages, blocks, x, y, steps: int):
    """``steps`` optimizer steps; per step the local grads and the (last stage) losses."""
    optimizer = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.1)
    history = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if any(s.is_first for s in stages):
            schedule.step(x, target=y, losses=losses)
        else:
            schedule.step(target=y, losses=losses)
        history.append(([p.grad.clone() for b in blocks for p in b.parameters()],
                        [loss.detach().clone() for loss in losses]))
        optimizer.step()
    return history


def reference_steps(chain, x, y, steps: int, local: list[int]):
    """The same training without pipelining: full batch, full model."""
    chain = [copy.deepcopy(b) for b in chain]
    optimizer = torch.optim.SGD([p for b in chain for p in b.parameters()], lr=0.1)
    history = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        out = x
        for block in chain:
            out = block(out)
        loss = loss_fn(out, y)
        loss.backward()
        history.append(([p.grad.clone() for s in local for p in chain[s].parameters()],
                        loss.detach()))
        optimizer.step()
    return history


def bitwise_equal(a, b) -> bool:
    """Whether two ``run_steps`` histories hold the same gradients and losses, bit for bit."""
    return all(
        len(ga) == len(gb) and all(torch.equal(u, v) for u, v in zip(ga, gb))
        and len(la) == len(lb) and all(torch.equal(u, v) for u, v in zip(la, lb))
        for (ga, la), (gb, lb) in zip(a, b)
    )


def coordinated_runs(rank: int, build: Callable, local_grads: Callable, fixed: list, hint: str,
                     n_microbatches: int, group: dist.ProcessGroup, coordination: str,
                     delay_seeds: tuple[int, ...], x, y, steps: int) -> dict:
    """ScheduleRRFP at hint+1 (plain readiness-first, so out-of-hint actions happen)
    coordinated over ``group``, without delays and with each of ``delay_seeds`` (per-rank
    send delays, in the first with a late activation that reorders actions;
    ``build(seed)`` adds the device delays): per run, whether its gradients
    equal ``fixed`` (torch's schedule) bitwise, the realized order and the coordination
    counts."""
    runs = {}
    for seed in (None, *delay_seeds):
        stages, blocks = build(seed)
        late = SECOND_ACTIVATION_LATE if seed == delay_seeds[0] else None
        schedule = StudySchedule(stages, n_microbatches, loss_fn=loss_fn, hint=hint,
                                 coordination_group=group,
                                 settings=Settings(buffer_limit="hint+1", stall_timeout=60,
                                                   policy="hint", coordination=coordination),
                                 study=Study(send_delay=None if seed is None else
                                             random_send_delay(seed * 7919 + rank, 0.003, late)))
        history = local_grads(run_steps(schedule, stages, blocks, x, y, steps))
        stats = schedule.last_step_stats
        runs["plain" if seed is None else f"seed{seed}"] = {
            "bitwise": bitwise_equal(history, fixed), "realized": stats.realized_order,
            "out_of_order": stats.out_of_hint_order, "rounds": stats.coordination_rounds,
            "deferrals": stats.coordination_deferrals,
            "coordination_us": stats.coordination_time * 1e6,
        }
    return runs
