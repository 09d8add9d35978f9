"""Receive-buffer memory: torch's own buffers vs rrfp's receive rings, measured.

torch <= 2.14 allocates one receive buffer per microbatch and input at shape inference
and keeps them all; torch 2.15 allocates each one lazily when its schedule posts the
receive, and lets go of it once the stage has consumed it (a liveness-based reuse).
rrfp's rings own ``limit + 1`` activation and ``limit`` gradient slots per incoming
channel and post receives ahead into them. This measures, per pipeline rank, the most
bytes of receive buffers alive at once:

* torch's fixed schedule: every buffer torch's ``_RecvInfo`` allocates (2.15's
  ``allocate_buffer``; on <= 2.14 the buffers bound at the end of the first step), alive
  until the last reference to it goes (weak references; autograd keeps a stage's input for
  its backward, so a buffer lives as long as its microbatch is held);
* rrfp: ``StepStats.receive_buffer_bytes``, the rings' slots.

    python -m benchmarks.receive_buffers_bench      # writes benchmarks/results/receive_buffers.md

2 CPU processes (gloo), 1F1B and Interleaved1F1B, 8 and 16 microbatches, float64
activations of 32 KiB per microbatch.
"""

from __future__ import annotations

import copy
import threading
import weakref

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class, PipelineScheduleSingle

from benchmarks.pages import write_page
from rrfp import ScheduleRRFP, Settings
from rrfp._torch_compat import TORCH_VERSION
from rrfp.testing.worlds import run_local_world

DIM, ROWS = 256, 16
"""Activations of ROWS x DIM float64 values (32 KiB) per microbatch."""


class _LiveBytes:
    """Bytes of the tensors registered and still alive, and their peak."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self._lock = threading.Lock()

    def add(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.untyped_storage().nbytes()
        with self._lock:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(tensor.untyped_storage(), self._drop, nbytes)

    def _drop(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes


def _stages(rank: int, world_size: int, stages_per_rank: int) -> list[PipelineStage]:
    torch.manual_seed(0)
    num_stages = world_size * stages_per_rank
    blocks = [torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh()).double()
              for _ in range(num_stages)]
    return [PipelineStage(copy.deepcopy(blocks[s]), s, num_stages, torch.device("cpu"))
            for s in range(rank, num_stages, world_size)]


def worker(rank: int, world_size: int, hint: str, stages_per_rank: int, M: int) -> dict:
    from torch.distributed.pipelining import _recv_buffers  # torch >= 2.15

    x, y = torch.randn(M * ROWS, DIM, dtype=torch.float64), torch.randn(M * ROWS, DIM, dtype=torch.float64)
    meter = _LiveBytes()
    allocate = _recv_buffers._RecvInfo.allocate_buffer

    def metered_allocate(info, device):
        buffer = allocate(info, device)
        meter.add(buffer)
        return buffer

    stages = _stages(rank, world_size, stages_per_rank)
    cls = get_schedule_class(hint)
    fixed = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, M,
                loss_fn=torch.nn.functional.mse_loss)
    first = any(s.is_first for s in stages)
    fixed.step(*((x,) if first else ()), target=y)  # shape inference, unmetered
    _recv_buffers._RecvInfo.allocate_buffer = metered_allocate
    try:
        fixed.step(*((x,) if first else ()), target=y)
    finally:
        _recv_buffers._RecvInfo.allocate_buffer = allocate
    result = {"torch": meter.peak}
    for limit in ("hint", "hint+2"):
        stages = _stages(rank, world_size, stages_per_rank)
        schedule = ScheduleRRFP(stages, M, loss_fn=torch.nn.functional.mse_loss, hint=hint,
                                settings=Settings(buffer_limit=limit))
        for _ in range(2):
            schedule.step(*((x,) if first else ()), target=y)
        result[limit] = schedule.last_step_stats.receive_buffer_bytes
        schedule.close()
    return result


def main() -> None:
    if TORCH_VERSION < (2, 15):
        raise SystemExit("this compares with torch 2.15's lazy receive buffers: run it on "
                         f"torch >= 2.15 (found {torch.__version__})")
    lines = [
        "# Receive-buffer memory: torch's lazy buffers vs rrfp's rings",
        "",
        f"Measured with `python -m benchmarks.receive_buffers_bench` on torch {torch.__version__}, "
        "2 CPU processes (gloo), float64 activations of 32 KiB per microbatch. Peak bytes of "
        "receive buffers alive at once per pipeline rank: for torch's fixed schedule every buffer "
        "its stages allocate (alive while referenced: autograd keeps a stage's input for its "
        "backward); for rrfp its rings' slots (`StepStats.receive_buffer_bytes`).",
        "",
        "On the last rank torch's buffers stay referenced past their microbatch's backward (not "
        "traced further here; a received activation is a leaf of the stage's graph, which the "
        "step's losses keep), so they grow with the microbatches; the rings' slots are reused once a "
        "microbatch's last backward piece has run, so they grow with the limit only. The first rank "
        "receives only gradients: torch holds the one its next backward needs, the ring holds "
        "`limit` slots, posted ahead.",
        "",
        "| hint | microbatches | rank | torch 2.15 (KiB) | rrfp at hint (KiB) | rrfp at hint+2 (KiB) |",
        "|---|---|---|---|---|---|",
    ]
    for hint, per_rank in (("1F1B", 1), ("Interleaved1F1B", 2)):
        for M in (8, 16):
            for rank, r in enumerate(run_local_world(2, worker, hint, per_rank, M, timeout=300)):
                lines.append(f"| {hint} | {M} | {rank} | {r['torch'] / 1024:.0f} | "
                             f"{r['hint'] / 1024:.0f} | {r['hint+2'] / 1024:.0f} |")
                print(lines[-1], flush=True)
    print(write_page("receive_buffers.md", lines))


if __name__ == "__main__":
    main()
