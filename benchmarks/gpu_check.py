"""GPU check of rrfp's device model and NCCL transport, ready to run on GPUs.

    python -m benchmarks.gpu_check                          # 1 GPU: one process, all stages
    python -m benchmarks.gpu_check --dry-run                # the same on CPU (CI runs this)
    torchrun --nproc-per-node 2 -m benchmarks.gpu_check --multi   # >= 2 GPUs over NCCL

Written against torch 2.13's documented CUDA and NCCL semantics on a machine without a GPU:
only ``--dry-run`` has been run (README, "GPU check").

**Single process** (all stages on one device, so every edge is local): ScheduleRRFP runs an
Interleaved1F1B hint over 4 stages on the device's current stream (``CudaDevice``: each
action between two timing events, completion by event queries). Checked:

1. gradients and losses are bitwise those of torch's ``ScheduleInterleaved1F1B`` on the
   same stages and inputs;
2. each action's device duration (stats spans, from the events) is within 10% (or 50 us)
   of ``torch.cuda.Event`` timings of the same kernels run on their own (on the dry run
   the median action within 15%: there the stage's Python bookkeeping runs on the emulated
   device too, and sleeps overshoot on busy cores);
3. launches returned before the work was done: the CPU spent less time launching than the
   device computing.

Kernel time is made to vary per stage and microbatch with ``torch.cuda._sleep`` (a spin
kernel). ``--dry-run`` does the same on CPU with ``EmulatedDevice`` and sleeps
(``EmulatedDeviceTime``), timing the same calls with ``time.perf_counter``.

**Multi-process** (``--multi``, one GPU per rank, NCCL): PP = world size, 1F1B and
Interleaved1F1B hints: bitwise equality with torch's fixed schedule over NCCL, then a timed
A/B (fixed schedule vs RRFP at ``hint+2``) with injected jitter, median step-time ratio.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import random
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import get_schedule_class, PipelineScheduleSingle

from rrfp import ScheduleRRFP
from rrfp.device import EmulatedDevice
from rrfp.emulation import EmulatedDeviceTime

STAGES = 4
MICROBATCHES = 8


class SpinKernel(torch.nn.Module):
    """A block whose forward also runs a spin kernel of a chosen length per microbatch,
    and whose backward another (``torch.cuda._sleep``: device time, not CPU time)."""

    def __init__(self, inner: torch.nn.Module, forward_cycles: list[int], backward_cycles: list[int]):
        super().__init__()
        self.inner = inner
        self.forward_cycles, self.backward_cycles = forward_cycles, backward_cycles
        self.calls = 0

    def reset(self) -> None:
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mb = self.calls % len(self.forward_cycles)
        self.calls += 1
        torch.cuda._sleep(self.forward_cycles[mb])
        out = self.inner(x)
        return _SpinInBackward.apply(out, self.backward_cycles[mb])


class _SpinInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, cycles: int) -> torch.Tensor:
        ctx.cycles = cycles
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        torch.cuda._sleep(ctx.cycles)
        return grad, None


def cycles_per_ms() -> float:
    """Spin-kernel cycles per millisecond on this GPU (timed with events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _blocks(dim: int, device: torch.device, dtype: torch.dtype) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU()).to(device, dtype)
            for _ in range(STAGES)]


def _step(schedule, stages, x, y) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    losses: list[torch.Tensor] = []
    if any(s.is_first for s in stages):
        schedule.step(x, target=y, losses=losses)
    else:
        schedule.step(target=y, losses=losses)
    return ([p.grad.clone() for s in stages for p in s.submod.parameters()],
            [loss.detach().clone() for loss in losses])


def single_process(dry_run: bool) -> None:
    """One process, all stages on one device (local edges only)."""
    device = torch.device("cpu") if dry_run else torch.device("cuda", 0)
    if dry_run:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    else:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1,
                                device_id=device)
    dim, dtype = (32, torch.float64) if dry_run else (1024, torch.float32)
    rng = random.Random(0)
    # Per stage and microbatch: forward 2-6 ms, backward 4-12 ms of device time.
    forward_ms = [[rng.uniform(2, 6) for _ in range(MICROBATCHES)] for _ in range(STAGES)]
    backward_ms = [[2 * rng.uniform(2, 6) for _ in range(MICROBATCHES)] for _ in range(STAGES)]
    per_ms = 1.0 if dry_run else cycles_per_ms()

    def timed(s: int, block: torch.nn.Module) -> torch.nn.Module:
        if dry_run:
            return EmulatedDeviceTime(block, MICROBATCHES, lambda mb: forward_ms[s][mb] / 1e3,
                                      lambda mb: backward_ms[s][mb] / 1e3)
        return SpinKernel(block, [int(ms * per_ms) for ms in forward_ms[s]],
                          [int(ms * per_ms) for ms in backward_ms[s]])

    blocks = _blocks(dim, device, dtype)
    x = torch.randn(MICROBATCHES * 4, dim, device=device, dtype=dtype)
    y = torch.randn(MICROBATCHES * 4, dim, device=device, dtype=dtype)
    loss_fn = torch.nn.functional.mse_loss

    def build() -> list[PipelineStage]:
        return [PipelineStage(timed(s, copy.deepcopy(blocks[s])), s, STAGES, device)
                for s in range(STAGES)]

    fixed_stages = build()
    fixed = get_schedule_class("Interleaved1F1B")(fixed_stages, MICROBATCHES, loss_fn=loss_fn)
    rrfp_stages = build()
    rrfp = ScheduleRRFP(rrfp_stages, MICROBATCHES, loss_fn=loss_fn, hint="Interleaved1F1B",
                        device=EmulatedDevice() if dry_run else None)
    for stages in (fixed_stages, rrfp_stages):
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)
    expected = _step(fixed, fixed_stages, x, y)
    got = _step(rrfp, rrfp_stages, x, y)
    bitwise = all(torch.equal(a, b) for a, b in zip(expected[0] + expected[1], got[0] + got[1]))
    print(f"[1] bitwise equal to torch's ScheduleInterleaved1F1B: {bitwise}")

    # Durations of one more step, against the same kernels timed on their own.
    for stage in rrfp_stages:
        stage.submod.zero_grad(set_to_none=True)
        stage.submod.reset()
    _step(rrfp, rrfp_stages, x, y)
    stats = rrfp.last_step_stats
    measured = {(sp.stage, sp.kind, sp.microbatch): sp.end - sp.start
                for sp in stats.spans if sp.kind in ("F", "B")}
    reference = _reference_durations(blocks, timed, x, device, dry_run)
    differences = sorted(abs(measured[k] - reference[k]) / reference[k] for k in reference)
    median = statistics.median(differences)
    if dry_run:
        # On CPU the stage's Python bookkeeping runs on the emulated device too, and sleeps
        # overshoot when the cores are busy: the typical action must match.
        close = median <= 0.15
    else:
        close = all(abs(measured[k] - reference[k]) <= max(0.1 * reference[k], 50e-6)
                    for k in reference)
    print(f"[2] device durations vs the same kernels timed alone, over {len(reference)} "
          f"actions: median relative difference {median:.1%}, worst {differences[-1]:.1%}: "
          f"{'ok' if close else 'MISMATCH'}")
    asynchronous = stats.launch_time < stats.device_busy_time
    print(f"[3] launch time {stats.launch_time * 1e3:.1f} ms < device busy "
          f"{stats.device_busy_time * 1e3:.1f} ms (launches return before the work is done): "
          f"{asynchronous}")
    rrfp.close()
    dist.destroy_process_group()
    if not (bitwise and close and asynchronous):
        raise SystemExit("gpu_check: FAILED")
    print("gpu_check: single-process checks passed" + (" (dry run on CPU)" if dry_run else ""))


def _reference_durations(blocks, timed, x, device, dry_run: bool) -> dict:
    """Each stage's forward and backward of each microbatch, timed on its own."""
    durations = {}
    chunks = x.chunk(MICROBATCHES)
    for s in range(STAGES):
        module = timed(s, copy.deepcopy(blocks[s]))
        for mb in range(MICROBATCHES):
            inp = chunks[mb].detach().requires_grad_()
            for kind in ("F", "B"):
                if dry_run:
                    start = time.perf_counter()
                else:
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                if kind == "F":
                    out = module(inp)
                else:
                    out.backward(torch.ones_like(out))
                if dry_run:
                    durations[(s, kind, mb)] = time.perf_counter() - start
                else:
                    end.record()
                    end.synchronize()
                    durations[(s, kind, mb)] = begin.elapsed_time(end) / 1e3
    return durations


def multi_process() -> None:
    """torchrun, one GPU per rank: RRFP vs torch's fixed schedule over NCCL."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=300))
    per_ms = cycles_per_ms()
    loss_fn = torch.nn.functional.mse_loss
    dim = 1024
    for hint, per_rank in (("1F1B", 1), ("Interleaved1F1B", 2)):
        num_stages = world * per_rank
        mapping = generate_stage_to_rank_mapping(world, num_stages, style="loop")
        local = [s for s in range(num_stages) if mapping[s] == rank]
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU()).to(device)
                  for _ in range(num_stages)]
        M = 4 * world
        x = torch.randn(M * 8, dim, device=device)
        y = torch.randn(M * 8, dim, device=device)
        rng = random.Random(rank)
        jitter = {s: [int(per_ms * rng.lognormvariate(1.0, 0.5)) for _ in range(M)] for s in local}

        def build(spin: bool) -> list[PipelineStage]:
            return [PipelineStage(SpinKernel(copy.deepcopy(blocks[s]), jitter[s], [2 * c for c in jitter[s]])
                                  if spin else copy.deepcopy(blocks[s]), s, num_stages, device)
                    for s in local]

        cls = get_schedule_class(hint)
        fixed_stages, rrfp_stages = build(False), build(False)
        fixed = cls(fixed_stages[0] if issubclass(cls, PipelineScheduleSingle) else fixed_stages,
                    M, loss_fn=loss_fn)
        rrfp = ScheduleRRFP(rrfp_stages, M, loss_fn=loss_fn, hint=hint)
        bitwise = all(torch.equal(a, b) for a, b in zip(
            sum(_step(fixed, fixed_stages, x, y), []), sum(_step(rrfp, rrfp_stages, x, y), [])))
        flags = [None] * world
        dist.all_gather_object(flags, bitwise)
        rrfp.close()

        fixed_stages, rrfp_stages = build(True), build(True)
        fixed = cls(fixed_stages[0] if issubclass(cls, PipelineScheduleSingle) else fixed_stages,
                    M, loss_fn=loss_fn)
        rrfp = ScheduleRRFP(rrfp_stages, M, loss_fn=loss_fn, hint=hint, buffer_limit="hint+2")
        times: dict[str, list[float]] = {"fixed": [], "rrfp": []}
        for step in range(6):
            for name, schedule, stages in (("fixed", fixed, fixed_stages), ("rrfp", rrfp, rrfp_stages)):
                torch.cuda.synchronize()
                dist.barrier()
                start = time.perf_counter()
                _step(schedule, stages, x, y)
                torch.cuda.synchronize()
                dist.barrier()
                if step > 0:
                    times[name].append(time.perf_counter() - start)
        rrfp.close()
        if rank == 0:
            ratio = statistics.median(f / r for f, r in zip(times["fixed"], times["rrfp"]))
            print(f"{hint}: bitwise equal on every rank: {all(flags)}; fixed "
                  f"{statistics.median(times['fixed']) * 1e3:.1f} ms, RRFP (hint+2) "
                  f"{statistics.median(times['rrfp']) * 1e3:.1f} ms per step, ratio {ratio:.3f}")
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true",
                      help="run the single-process checks on CPU with the emulated device")
    mode.add_argument("--multi", action="store_true",
                      help="under torchrun, one GPU per rank: NCCL bitwise check and timed A/B")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; use --dry-run to run the checks on CPU")
    if args.multi:
        multi_process()
    else:
        single_process(args.dry_run)


if __name__ == "__main__":
    main()
