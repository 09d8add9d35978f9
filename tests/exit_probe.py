"""A job that never closes its ScheduleRRFP (tests/test_examples.py): after a step it
destroys the process group and exits. A probe registered with ``atexit`` before the
schedule was built runs after the schedule's own exit handler (atexit runs them last in,
first out) and prints the schedule's threads still alive then: none, once the schedule
closed itself. Run: ``torchrun --nproc-per-node 2 tests/exit_probe.py``."""

import atexit
import os
import threading

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from rrfp import ScheduleRRFP


def probe() -> None:
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("rrfp-"))
    print(f"rank {os.environ.get('RANK')}: rrfp threads alive "
          f"at exit: {alive}", flush=True)


atexit.register(probe)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
blocks = {s: torch.nn.Linear(8, 8) for s in range(2 * world)}
stages = [PipelineStage(blocks[s], s, 2 * world, torch.device("cpu")) for s in (rank, rank + world)]
schedule = ScheduleRRFP(stages, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss,
                        hint="Interleaved1F1B")
schedule.step(*((torch.randn(8, 8),) if rank == 0 else ()), target=torch.randn(8, 8), losses=[])
dist.destroy_process_group()
