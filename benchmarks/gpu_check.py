"""GPU check of rrfp's device model and NCCL transport, ready to run on GPUs.

    python -m benchmarks.gpu_check                          # 1 GPU: one process, all stages
    python -m benchmarks.gpu_check --dry-run                # the same on CPU (CI runs this)
    torchrun --nproc-per-node 2 -m benchmarks.gpu_check --multi   # >= 2 GPUs over NCCL

The single-process part has run on one NVIDIA H200, on that machine's torch 2.11 through
``benchmarks/torch_2_11`` (benchmarks/results/gpu_check.md); ``--multi`` needs two GPUs and
has not run: it is written against torch 2.13's documented CUDA and NCCL semantics.

**Single process** (all stages on one device, so every edge is local): ScheduleRRFP runs an
Interleaved1F1B hint over 4 stages on the device's current stream (``CudaDevice``: each
action between two timing events, completion by event queries). Checked:

1. gradients and losses are bitwise those of torch's ``ScheduleInterleaved1F1B`` on the
   same stages and inputs;
2. each action's device duration (stats spans, from the events) is within 10% (or 50 us)
   of what torch's profiler (CUPTI) saw of the kernels the action launched in the same
   step (on the dry run, with kernels five times longer, every span at least its emulated
   kernel time and the median span within 1.5x of the kernel timed alone: there the
   stage's Python bookkeeping runs on the emulated device too, and sleeps overshoot on
   busy cores);
3. launches returned before the work was done: the CPU spent less time launching than the
   device computing.

Then, as reports on the GPU: the device's idle time inside one profiled step of each
schedule, with RRFP's longest gaps and the actions on either side (``[idle]``), and step
wall time of torch's schedule and RRFP with all stages on one stream (``[A/B]``: no
overlap to find, so what differs is host time the device waits for).

Kernel time is made to vary per stage and microbatch with ``torch.cuda._sleep`` (a spin
kernel). ``--dry-run`` does the same on CPU with ``EmulatedDevice`` and sleeps
(``EmulatedDeviceTime``), timing the same calls with ``time.perf_counter``.

**Multi-process** (``--multi``, one GPU per rank, NCCL): PP = world size, 1F1B and
Interleaved1F1B hints: bitwise equality with torch's fixed schedule over NCCL, then a timed
A/B (fixed schedule vs RRFP at ``hint+2``) with injected jitter, median step-time ratio.
The process group is initialized as torch users get it by default (no ``device_id``):
with ``device_id`` torch runs every unbatched P2P of its fixed schedule on the one world
communicator, serialized, while RRFP uses one communicator per channel, which would favour
RRFP (``--device-id`` runs that variant, saying so).

**Transport** (``--multi`` on >= 2 GPUs over NCCL; ``--dry-run`` on 2 CPU processes over
gloo, the same code), pipeline ranks 0 and 1, channel by channel (``rrfp.comm.transport``):

4. many channels at once: the channels of an Interleaved1F1B hint with 4 stages per rank,
   one message on each, all posted before any is sent;
5. a receive posted while compute is queued: the consumer queues a long kernel (a 0.2 s
   spin; on CPU the emulated device's work), then posts a receive (under the receive side
   stream); the producer sends at once. The arrival must be seen long before the kernel
   ends (median over rounds). On CUDA the same receive posted under the compute stream
   (how rrfp posted them before) is measured too: it waits for the kernel;
6. a clean close: the producer sends 4 messages of 16 MiB and closes at once, while the
   consumer posts each receive 0.1 s after the last arrived; every message must arrive
   (the close completes the sends in flight first);
7. failure: the producer publishes a failure and aborts its channels while the consumer
   waits for a message; the consumer must raise ``PeerFailedError`` naming it within 2 s
   (an NCCL abort does not reach the peer: only the store tells it), then both build new
   channels in the same process and exchange a message (torch's watchdog did not end it).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import random
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import get_schedule_class, PipelineScheduleSingle

from rrfp import ScheduleRRFP, Settings
from rrfp.testing.emulation import EmulatedDevice, EmulatedDeviceTime
from rrfp.testing.study import Study, StudySchedule

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
    """Spin-kernel cycles per millisecond on this GPU (timed with events), once the SM clock
    has risen: a spin kernel counts clock cycles, and calibrated at an idle clock the
    step's kernels ran 4-5 times shorter than asked (seen on an H200)."""
    torch.cuda._sleep(1_000_000_000)
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
    # Per stage and microbatch: forward 2-6 ms, backward 4-12 ms of device time; on the dry
    # run five times that, so that what a loaded CPU adds to a span (a late wake-up, the
    # stage's bookkeeping: 6 ms for the median action, seen at load 12) stays well within
    # the check's margin.
    scale = 5 if dry_run else 1
    forward_ms = [[scale * rng.uniform(2, 6) for _ in range(MICROBATCHES)]
                  for _ in range(STAGES)]
    backward_ms = [[scale * 2 * rng.uniform(2, 6) for _ in range(MICROBATCHES)]
                   for _ in range(STAGES)]
    per_ms = 1.0 if dry_run else cycles_per_ms()
    if not dry_run:
        print(f"spin kernels: {per_ms:.0f} cycles per ms on {torch.cuda.get_device_name(device)}, "
              f"torch {torch.__version__}")

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
    rrfp = StudySchedule(rrfp_stages, MICROBATCHES, loss_fn=loss_fn, hint="Interleaved1F1B",
                         study=Study(device=EmulatedDevice() if dry_run else None))
    for stages in (fixed_stages, rrfp_stages):
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)
    expected = _step(fixed, fixed_stages, x, y)
    got = _step(rrfp, rrfp_stages, x, y)
    bitwise = all(torch.equal(a, b) for a, b in zip(expected[0] + expected[1], got[0] + got[1]))
    print(f"[1] bitwise equal to torch's ScheduleInterleaved1F1B: {bitwise}")

    # Durations of one more step: on the GPU against what the profiler (CUPTI) saw of the
    # same step's kernels; on the dry run against the same emulated kernels timed alone.
    _restart(rrfp_stages)
    if dry_run:
        _step(rrfp, rrfp_stages, x, y)
        close, described = _durations_vs_alone(rrfp.last_step_stats, blocks, timed, x,
                                               forward_ms, backward_ms)
    else:
        rrfp_kernels = _profiled_kernels(rrfp, rrfp_stages, x, y)
        close, described = _durations_vs_profiler(rrfp.last_step_stats, rrfp_kernels)
    print(f"[2] {described}: {'ok' if close else 'MISMATCH'}")
    stats = rrfp.last_step_stats
    asynchronous = stats.launch_time < stats.device_busy_time
    print(f"[3] launch time {stats.launch_time * 1e3:.1f} ms < device busy "
          f"{stats.device_busy_time * 1e3:.1f} ms (launches return before the work is done): "
          f"{asynchronous}")
    if not dry_run:
        _restart(fixed_stages)
        print(_idle_report(_profiled_kernels(fixed, fixed_stages, x, y), rrfp_kernels))
        one_stream_ab(fixed, fixed_stages, rrfp, rrfp_stages, x, y)
    rrfp.close()
    dist.destroy_process_group()
    if not (bitwise and close and asynchronous):
        raise SystemExit("gpu_check: FAILED")
    print("gpu_check: single-process checks passed" + (" (dry run on CPU)" if dry_run else ""))


def _restart(stages: list[PipelineStage]) -> None:
    """Before a step measured on its own: no gradients, each block's timed kernels counted
    again from microbatch 0."""
    for stage in stages:
        stage.submod.zero_grad(set_to_none=True)
        stage.submod.reset()


def _durations_vs_alone(stats, blocks, timed, x, forward_ms, backward_ms) -> tuple[bool, str]:
    """Dry run: each action's span against the same emulated kernels timed on their own.

    On CPU the stage's Python bookkeeping runs on the emulated device too, and sleeps
    overshoot when the cores are busy (a median difference of 18% was seen with both cores
    loaded). What the check means holds with margins such a machine keeps: a span is the
    action's own run, not its launch (which returns at once: a span is at least the
    emulated kernel time it slept) nor its time since launch (which adds the queue ahead
    of it, about one more action at launch depth 2: the typical span would be twice the
    action timed alone)."""
    measured = {(sp.stage, sp.kind, sp.microbatch): sp.end - sp.start
                for sp in stats.spans if sp.kind in ("F", "B")}
    alone = {}
    chunks = x.chunk(MICROBATCHES)
    for s in range(STAGES):
        module = timed(s, copy.deepcopy(blocks[s]))
        for mb in range(MICROBATCHES):
            inp = chunks[mb].detach().requires_grad_()
            start = time.perf_counter()
            out = module(inp)
            alone[(s, "F", mb)] = time.perf_counter() - start
            start = time.perf_counter()
            out.backward(torch.ones_like(out))
            alone[(s, "B", mb)] = time.perf_counter() - start
    slept = {(s, kind, mb): (forward_ms if kind == "F" else backward_ms)[s][mb] / 1e3
             for (s, kind, mb) in alone}
    differences = sorted(abs(measured[k] - alone[k]) / alone[k] for k in alone)
    ratio = statistics.median(measured[k] / alone[k] for k in alone)
    close = all(measured[k] >= 0.99 * slept[k] for k in alone) and ratio <= 1.5
    return close, (f"device durations vs the same kernels timed alone, over {len(alone)} "
                   f"actions: median relative difference {statistics.median(differences):.1%}, "
                   f"worst {differences[-1]:.1%}; every span at least its emulated kernel "
                   f"time, median ratio {ratio:.2f} (<= 1.5)")


Kernel = tuple[float, float, "str | None"]
"""A device kernel, copy or set of a profiled step: start and end (trace microseconds) and
the action whose ``PP:<action>`` host range holds its launch (None: no action's)."""


def _profiled_kernels(schedule, stages, x, y) -> list[Kernel]:
    """One step of ``schedule`` under torch's profiler (CUPTI): its kernels in start order."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        _step(schedule, stages, x, y)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profile.export_chrome_trace(path)
        with open(path) as trace:
            return _kernels(json.load(trace)["traceEvents"])


def _durations_vs_profiler(stats, kernels: list[Kernel]) -> tuple[bool, str]:
    """GPU: each action's span (``CudaDevice``'s events) against the GPU time torch's
    profiler (CUPTI) saw for the kernels the action launched, in the same step: from its
    first kernel's start to its last one's end. A kernel belongs to the action whose host
    range (rrfp names it as torch's schedules do, ``PP:<action>``) holds the kernel's
    launch, on any thread: a backward's kernels are launched by autograd's engine thread
    while the action's range is open, which is why the profiler's own GPU ranges miss
    them. Timing the kernels again on their own would compare two clocks: a spin
    kernel's length follows the SM clock, which moves between steps (differences up to
    21% were seen on an H200)."""
    seen = _kernel_extents(kernels)
    spans = {sp.name: sp.end - sp.start for sp in stats.spans if sp.kind in ("F", "B")}
    both = [name for name in spans if name in seen]
    if not both:
        return False, f"the profile holds no kernel of rrfp's {len(spans)} actions"
    relative = {n: abs(spans[n] - seen[n]) / seen[n] for n in both}
    close = len(both) == len(spans) and all(
        abs(spans[n] - seen[n]) <= max(0.1 * seen[n], 50e-6) for n in both)
    worst = max(relative, key=relative.__getitem__)
    absent = sorted(set(spans) - set(seen))
    return close, (f"device durations vs the profiler's kernels of the same step, over "
                   f"{len(both)} of {len(spans)} actions: median relative difference "
                   f"{statistics.median(relative.values()):.1%}, worst {relative[worst]:.1%} ({worst}: "
                   f"span {spans[worst] * 1e3:.3f} ms, kernels {seen[worst] * 1e3:.3f} ms)"
                   + (f"; no kernel for {', '.join(absent[:8])}" if absent else ""))


def _kernels(events: list[dict]) -> list[Kernel]:
    """The device kernels, copies and sets of a Chrome trace, in start order, each with the
    action (``PP:<action>`` host range, on any thread) that launched it."""
    ranges = [(e["ts"], e["ts"] + e["dur"], e["name"].removeprefix("PP:")) for e in events
              if e.get("cat") == "user_annotation" and e.get("name", "").startswith("PP:")]
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    kernels = []
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        at = launched.get(e["args"].get("correlation"))
        owners = [name for first, last, name in ranges if at is not None and first <= at <= last]
        kernels.append((e["ts"], e["ts"] + e["dur"], owners[-1] if owners else None))
    return sorted(kernels, key=lambda kernel: kernel[0])


def _kernel_extents(kernels: list[Kernel]) -> dict[str, float]:
    """Per action: seconds from the start of the first kernel it launched to the end of the
    last."""
    extents: dict[str, tuple[float, float]] = {}
    for start, end, owner in kernels:
        if owner is not None:
            begin, finish = extents.get(owner, (start, end))
            extents[owner] = (min(begin, start), max(finish, end))
    return {name: (finish - begin) / 1e6 for name, (begin, finish) in extents.items()}


SHORTEST_GAP_US = 5.0
"""Idle stretches shorter than this are left out of the ``[idle]`` report."""


def _idle_gaps(kernels: list[Kernel],
               shortest_us: float = SHORTEST_GAP_US) -> list[tuple[float, str, str]]:
    """Where the device ran nothing between a step's first kernel and its last: (seconds,
    the action whose kernel ran last before the gap, the action whose kernel ends it),
    longest first, for gaps of at least ``shortest_us`` ("-": a kernel of no action)."""
    gaps = []
    busy_until, before = None, None
    for start, end, owner in kernels:
        if busy_until is not None and start - busy_until >= shortest_us:
            gaps.append(((start - busy_until) / 1e6, before or "-", owner or "-"))
        if busy_until is None or end >= busy_until:
            busy_until, before = end, owner
    return sorted(gaps, key=lambda gap: -gap[0])


def _idle_report(fixed: list[Kernel], rrfp: list[Kernel]) -> str:
    """Report (no pass or fail): the device's idle time inside one step of each schedule,
    and RRFP's longest gaps with the actions around them."""
    fixed_gaps, rrfp_gaps = _idle_gaps(fixed), _idle_gaps(rrfp)

    def total(gaps: list[tuple[float, str, str]]) -> str:
        return f"{sum(g for g, _, _ in gaps) * 1e3:.2f} ms in {len(gaps)} gaps"
    longest = ", ".join(f"{gap * 1e3:.3f} ms {before} -> {after}"
                        for gap, before, after in rrfp_gaps[:4])
    return (f"[idle] device idle between a step's first and last kernel, gaps of "
            f"{SHORTEST_GAP_US:.0f} us or more (a report): torch fixed {total(fixed_gaps)}, "
            f"RRFP {total(rrfp_gaps)}; RRFP's longest: {longest or 'none'}")


def one_stream_ab(fixed, fixed_stages, rrfp, rrfp_stages, x, y, rounds: int = 8) -> None:
    """Report (no pass or fail): step wall time of torch's fixed schedule and RRFP with all
    stages on one stream, alternating, after 2 warm-up rounds. One stream leaves no
    overlap to find, so the difference is the host work each leaves unhidden; RRFP's
    loop time (its stats) beside its wall time shows how much lies outside the loop."""
    times: dict[str, list[float]] = {"fixed": [], "rrfp": []}
    loop_ms = []
    for round_ in range(rounds + 2):
        for name, schedule, stages in (("fixed", fixed, fixed_stages), ("rrfp", rrfp, rrfp_stages)):
            for stage in stages:
                stage.submod.reset()
            torch.cuda.synchronize()
            start = time.perf_counter()
            _step(schedule, stages, x, y)
            torch.cuda.synchronize()
            if round_ >= 2:
                times[name].append((time.perf_counter() - start) * 1e3)
        if round_ >= 2:
            loop_ms.append(rrfp.last_step_stats.step_time * 1e3)
    fixed_ms, rrfp_ms = statistics.median(times["fixed"]), statistics.median(times["rrfp"])
    print(f"[A/B] one stream, {rounds} alternating rounds (a report): median step torch fixed "
          f"{fixed_ms:.1f} ms, RRFP {rrfp_ms:.1f} ms (its loop {statistics.median(loop_ms):.1f} ms), "
          f"RRFP/fixed {rrfp_ms / fixed_ms:.3f}; per round "
          + " ".join(f"{b / a:.3f}" for a, b in zip(times["fixed"], times["rrfp"])))


def multi_process(device_id: bool = False) -> None:
    """torchrun, one GPU per rank: RRFP vs torch's fixed schedule over NCCL, then the
    transport checks."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    # No device_id by default: as torch users get it (torchtitan passes none), torch's
    # fixed schedule then runs its P2P on a communicator per peer pair; with device_id,
    # on the one world communicator, serialized (a baseline that favours RRFP).
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300),
                            **({"device_id": device} if device_id else {}))
    if rank == 0:
        print("process group: " + ("device_id bound (torch's P2P serialized on the world "
                                   "communicator: favours RRFP)" if device_id else
                                   "no device_id (torch's P2P per peer pair, as by default)"))
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
        rrfp = ScheduleRRFP(rrfp_stages, M, loss_fn=loss_fn, hint=hint,
                            settings=Settings(buffer_limit="hint+2"))
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
    ok = transport_checks(rank, world, device)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit("gpu_check: transport checks FAILED")


def _spin(device: torch.device, seconds: float, per_ms: float) -> None:
    """Queue ``seconds`` of work behind the current stream (CPU: done by the caller)."""
    if device.type == "cuda":
        torch.cuda._sleep(int(seconds * 1e3 * per_ms))


def _await(transport, board, edge, count: int, timeout: float = 60.0) -> list[float]:
    """Poll ``transport`` until ``count`` messages arrived on ``edge``, checking ``board``
    for a peer's failure; their host times."""
    seen, deadline = [], time.perf_counter() + timeout
    while len(seen) < count:
        board.check()
        seen += [time.perf_counter() for r in transport.collect() if r.edge == edge]
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{count - len(seen)} messages on {edge} did not arrive")
        time.sleep(20e-6)
    return seen


def transport_checks(rank: int, world: int, device: torch.device) -> bool:
    """Checks 4-7 (see the module docstring) between pipeline ranks 0 and 1; the other
    ranks only take part in creating the channels. Prints from rank 1; returns whether
    they passed (the same on every rank)."""
    from rrfp.testing.emulation import EmulatedDevice
    from rrfp.core.wakeup import Wakeup
    from rrfp.core.hints import build_hint
    from rrfp.comm.board import FailureBoard
    from rrfp.comm.channels import create_channels
    from rrfp.core.errors import PeerFailedError
    from rrfp.devices.platform import platform_for, ReceiveStreams
    from rrfp.comm.transport import Transport

    cuda = device.type == "cuda"
    per_ms = cycles_per_ms() if cuda else 1.0
    results: dict[str, bool] = {}
    pair = dist.new_group([0, 1], backend="gloo")  # every rank creates it; 0 and 1 use it

    def say(line: str) -> None:
        if rank == 1:
            print(line, flush=True)

    def make(hint_name: str, stages_per_rank: int) -> tuple[Transport, FailureBoard]:
        hint = build_hint(hint_name, num_ranks=world, num_stages=world * stages_per_rank,
                          n_microbatches=world * stages_per_rank, layout="loop")
        platform = platform_for(device)
        channels = create_channels(hint, None, device, platform.channel_backend)
        board = FailureBoard(channels.store, rank, channels.global_ranks)
        return (Transport(channels, Wakeup(), board, receive_streams=platform.receive_streams()),
                board)

    # Receive buffers come from torch.empty: no kernel writes them on the compute stream,
    # which a receive posted under the side stream does not wait for.
    # [4] many channels at once
    transport, board = make("Interleaved1F1B", 4)
    mine = sorted(transport.channels.values(), key=lambda c: c.edge)
    buffers = {}
    for channel in mine:
        if channel.rank == 1:
            buffers[channel.edge] = torch.empty(1024, device=device)
            transport.post_receive(channel.edge, 0, [buffers[channel.edge]])
    dist.barrier()
    for channel in mine:
        if channel.rank == 0:
            transport.send(channel.edge, 0, [torch.full((1024,), float(channel.edge.src),
                                                        device=device)])
    arrived: set = set()
    deadline = time.perf_counter() + 60
    while len(arrived) < len(buffers) and time.perf_counter() < deadline:
        arrived |= {r.edge for r in transport.collect()}
    correct = len(arrived) == len(buffers) and all(
        bool((b == e.src).all()) for e, b in buffers.items())
    transport.finish_sends(60)
    transport.close(30)
    counts = [None] * world
    dist.all_gather_object(counts, (len(mine), correct))
    results["many"] = all(ok for _, ok in counts)
    say(f"[4] {sum(n for n, _ in counts) // 2} channels of an Interleaved1F1B hint (4 stages "
        f"per rank), one message on each, all received: {results['many']}")

    if rank > 1:  # the remaining checks run between pipeline ranks 0 and 1
        transport, board = make("1F1B", 1)  # every rank creates the same generations
        transport.close(30)
        transport, board = make("1F1B", 1)
        transport.close(30)
        transport, board = make("1F1B", 1)
        transport.close(30, failed=True)
        transport, board = make("1F1B", 1)
        transport.close(30)
        flags = [None] * world
        dist.all_gather_object(flags, True)
        return all(flags)

    # [5] a receive posted while compute is queued
    kernel, rounds = 0.2, 5
    transport, board = make("1F1B", 1)
    edge = next(c.edge for c in transport.channels.values() if c.edge.is_forward)
    modes = ["side stream"] + (["compute stream (before)"] if cuda else [])
    latency: dict[str, list[float]] = {m: [] for m in modes}
    device_thread = None if cuda else EmulatedDevice()
    if device_thread is not None:
        device_thread.begin_step(time.perf_counter(), Wakeup())
    for mode in modes:
        if mode != "side stream":
            transport.receive_streams = ReceiveStreams(None)  # posted on the current stream
        for _ in range(rounds):
            buffer = torch.empty(4096, device=device)
            dist.barrier(group=pair)
            if rank == 1:
                queued = time.perf_counter()
                if cuda:
                    _spin(device, kernel, per_ms)
                else:
                    from rrfp.core.actions import _Action, F
                    device_thread.launch(_Action(1, F, 0), lambda: time.sleep(kernel))
                transport.post_receive(edge, 0, [buffer])
                (at,) = _await(transport, board, edge, 1)
                latency[mode].append(at - queued)
                if cuda:
                    torch.cuda.synchronize()
                else:
                    while device_thread.outstanding:
                        device_thread.completed()
                        time.sleep(1e-3)
            else:
                transport.send(edge, 0, [torch.ones(4096, device=device)])
                transport.finish_sends(60)
                if cuda:
                    torch.cuda.synchronize()
            dist.barrier(group=pair)
        transport.receive_streams = ReceiveStreams(device)
    if device_thread is not None:
        device_thread.close(5)
    transport.close(30)
    if rank == 1:
        medians = {m: statistics.median(v) for m, v in latency.items()}
        results["arrival"] = medians["side stream"] < 0.25 * kernel
        say(f"[5] arrival with {kernel * 1e3:.0f} ms of compute queued ahead, median of "
            f"{rounds}: " + ", ".join(f"posted under the {m} {v * 1e3:.1f} ms"
                                      for m, v in medians.items())
            + f" (must be < {0.25 * kernel * 1e3:.0f} ms under the side stream): "
            f"{results['arrival']}")

    # [6] a clean close with sends in flight
    transport, board = make("1F1B", 1)
    edge = next(c.edge for c in transport.channels.values() if c.edge.is_forward)
    numel, count = 4 * 1024 * 1024, 4  # 16 MiB of float32 each: more than NCCL buffers
    dist.barrier(group=pair)
    if rank == 0:
        for i in range(count):
            transport.send(edge, i, [torch.full((numel,), float(i), device=device)])
        transport.finish_sends(300)
        transport.close(30, send_timeout=300)  # healthy: completes the sends first
    else:
        got = []
        for i in range(count):
            time.sleep(0.1)
            buffer = torch.empty(numel, device=device)
            transport.post_receive(edge, i, [buffer])
            _await(transport, board, edge, 1)
            got.append(bool((buffer == i).all()))
        transport.close(30)
        results["close"] = all(got) and len(got) == count
        say(f"[6] the producer closed right after its sends; all {count} messages of 16 MiB "
            f"arrived afterwards: {results['close']}")

    # [7] failure: told through the store, then new channels in the same process
    transport, board = make("1F1B", 1)
    edge = next(c.edge for c in transport.channels.values() if c.edge.is_forward)
    dist.barrier(group=pair)
    if rank == 0:
        time.sleep(0.5)  # the consumer is waiting by now
        failed_at = time.time()
        board.publish("gpu_check: failed on purpose")
        transport.close(30, failed=True)
        dist.broadcast_object_list([failed_at], src=0, group=pair)
    else:
        transport.post_receive(edge, 0, [torch.empty(16, device=device)])
        named = False
        try:
            _await(transport, board, edge, 1, timeout=300)
        except PeerFailedError as e:
            named = e.failed_rank == 0 and "failed on purpose" in str(e)
        raised_at = time.time()
        transport.close(30, failed=True)
        sent_at = [None]
        dist.broadcast_object_list(sent_at, src=0, group=pair)
        delay = raised_at - sent_at[0]
        results["failure"] = named and delay < 2.0
        say(f"[7] the consumer raised PeerFailedError naming global rank 0, {delay:.2f} s "
            f"after its failure (< 2 s): {results['failure']}")
    transport, board = make("1F1B", 1)  # recovery: fresh channels in the same process
    edge = next(c.edge for c in transport.channels.values() if c.edge.is_forward)
    buffer = torch.empty(16, device=device)
    if rank == 1:
        transport.post_receive(edge, 0, [buffer])
        _await(transport, board, edge, 1)
    else:
        transport.send(edge, 0, [torch.full((16,), 7.0, device=device)])
        transport.finish_sends(60)
    transport.close(30)
    if rank == 1:
        results["recovered"] = bool((buffer == 7).all())
        say(f"    then new channels in the same process carried a message: "
            f"{results['recovered']}")
    flags = [None] * world
    dist.all_gather_object(flags, all(results.values()))
    return all(flags)


def transport_world(rank: int, world: int) -> bool:
    """The transport checks on CPU (gloo), in a local world (``rrfp.testing.worlds``)."""
    return transport_checks(rank, world, torch.device("cpu"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true",
                      help="run the single-process checks on CPU with the emulated device")
    mode.add_argument("--multi", action="store_true",
                      help="under torchrun, one GPU per rank: NCCL bitwise check, timed A/B, "
                           "transport checks")
    parser.add_argument("--device-id", action="store_true",
                        help="with --multi: init with device_id (torch's P2P serialized on "
                             "the world communicator; favours RRFP)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; use --dry-run to run the checks on CPU")
    if args.multi:
        multi_process(args.device_id)
    else:
        single_process(args.dry_run)
        if args.dry_run:
            from rrfp.testing.worlds import run_local_world

            if not all(run_local_world(2, transport_world, timeout=300)):
                raise SystemExit("gpu_check: transport checks FAILED")
            print("gpu_check: transport checks passed (dry run on CPU, 2 processes, gloo)")


if __name__ == "__main__":
    main()
