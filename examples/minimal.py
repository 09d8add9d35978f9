"""Minimal ScheduleRRFP training loop. Run: torchrun --nproc-per-node 2 examples/minimal.py"""

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from rrfp import ScheduleRRFP, Settings

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
# Two model chunks per rank, placed in a loop (stage s on rank s % world), as Interleaved1F1B wants.
blocks = {s: torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()) for s in range(2 * world)}
stages = [PipelineStage(blocks[s], s, 2 * world, torch.device("cpu")) for s in (rank, rank + world)]

params = [p for s in (rank, rank + world) for p in blocks[s].parameters()]
optimizer = torch.optim.SGD(params, lr=0.05)
x, y = torch.randn(64, 32), torch.randn(64, 32)
# Leaving the block closes the schedule: its threads stop and its channels go before the
# process group does.
with ScheduleRRFP(stages, n_microbatches=8, loss_fn=torch.nn.functional.mse_loss,
                  hint="Interleaved1F1B",
                  settings=Settings(buffer_limit="hint", stall_timeout=300.0)) as schedule:
    for step in range(5):
        optimizer.zero_grad()
        losses = []
        inputs = (x,) if rank == 0 else ()  # only the first stage takes the batch
        schedule.step(*inputs, target=y, losses=losses)
        optimizer.step()
        if losses:
            print(f"step {step}: loss {torch.stack(losses).mean():.4f}")
    print(schedule.last_step_stats.summary())
dist.destroy_process_group()
