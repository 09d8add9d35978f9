"""Microbatches of different shapes on CPU/gloo: bitwise the fixed order on the same data, one
header per activation and none for fixed shapes, headers on the host on NCCL channels, a
shape that breaks the model fails every rank (each world has a hard timeout)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist

from rrfp import Settings
from rrfp.testing.chains import (BATCH_PER_MICROBATCH, bitwise_equal, build_stages, DIM,
                                 local_stage_indices, loss_fn, make_batch, make_chain)
from rrfp.testing.emulation import EmulatedDevice
from rrfp.testing.nccl_like import channels_for
from rrfp.testing.probes import error_chain
from rrfp.testing.study import Study, StudySchedule
from rrfp.testing.timing import random_device_time, random_send_delay, SECOND_ACTIVATION_LATE
from rrfp.testing.worlds import run_local_world


def variable_batches(n_microbatches: int, lengths: list[int], seed: int):
    """Per microbatch an input and a target of shape [2, length, DIM] (float64)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, lengths[m % len(lengths)], DIM, generator=g, dtype=torch.float64)
          for m in range(n_microbatches)]
    ys = [torch.randn_like(x) for x in xs]
    return xs, ys


def variable_shapes(rank: int, world_size: int, hint: str, per_rank: int, layout: str,
                    delay_seed: int, kind: str = "gloo") -> dict:
    """Microbatches of different sequence lengths, and other lengths the next step: RRFP
    (variable_shapes, emulated device, random delays) vs RRFP's fixed policy on the same
    data, bitwise, and vs the unpipelined float64 model. ``kind``: the channels
    (``channels_for``); on ``"nccl-like"`` ones, also what went over them."""
    channels = channels_for(kind)
    num_stages, M = world_size * per_rank, 2 * world_size
    chain = make_chain(num_stages)
    local = local_stage_indices(rank, world_size, num_stages, layout)
    data = [variable_batches(M, lengths, seed=step)
            for step, lengths in enumerate(([3, 7, 2, 5], [6, 1, 4]))]

    def run(policy: str, delayed: bool):
        wrap = (lambda s, b: random_device_time(delay_seed, s, M, 0.003)(b)) if delayed else None
        stages, blocks = build_stages(chain, rank, world_size, layout, wrap=wrap)
        # Delayed: also a late activation that reorders actions.
        send_delay = (random_send_delay(delay_seed * 31 + rank, 0.003, SECOND_ACTIVATION_LATE)
                      if delayed else None)
        schedule = StudySchedule(stages, M, loss_fn=loss_fn, hint=hint,
                                 settings=Settings(policy=policy, variable_shapes=True,
                                                   buffer_limit="hint+1", stall_timeout=60),
                                 study=Study(device=EmulatedDevice(), send_delay=send_delay,
                                             channels=channels))
        optimizer = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.1)
        history = []
        for xs, ys in data:
            optimizer.zero_grad(set_to_none=True)
            losses: list = []
            schedule.step(
                arg_mbs=[(x,) for x in xs] if any(s.is_first for s in stages) else None,
                target_mbs=ys if any(s.is_last for s in stages) else None, losses=losses)
            history.append(([p.grad.clone() for b in blocks for p in b.parameters()],
                            [loss.detach().clone() for loss in losses]))
            optimizer.step()
        stats = schedule.last_step_stats
        schedule.close()
        return history, stats

    fixed, _ = run("fixed", delayed=False)
    rrfp, stats = run(None, delayed=True)

    reference = [copy.deepcopy(b) for b in chain]
    optimizer = torch.optim.SGD([p for b in reference for p in b.parameters()], lr=0.1)
    errors = []
    for (xs, ys), (grads, _) in zip(data, fixed):
        optimizer.zero_grad(set_to_none=True)
        total = 0
        for x, y in zip(xs, ys):
            out = x
            for block in reference:
                out = block(out)
            total = total + loss_fn(out, y)
        (total / M).backward()
        expected = [p.grad for s in local for p in reference[s].parameters()]
        errors.append(max((g - e).abs().max().item() for g, e in zip(grads, expected)))
        optimizer.step()
    result = {"bitwise": bitwise_equal(rrfp, fixed), "error": max(errors),
              "out_of_order": stats.out_of_hint_order,
              "receive_bytes": stats.receive_buffer_bytes}
    if channels is not None:  # the dtypes sent over the (NCCL-like) data channels
        result["data_dtypes"] = sorted({str(d) for g in channels.groups.made
                                         for d in g.sent_dtypes})
    return result


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("hint,per_rank,layout", [
    ("1F1B", 1, "loop"), ("Interleaved1F1B", 2, "loop"), ("ZBVZeroBubble", 2, "v"),
    ("BFW", 2, "v")])
def test_microbatches_of_different_shapes(hint, per_rank, layout, world_size):
    seed = 17 * world_size + per_rank + len(hint)
    ranks = run_local_world(world_size, variable_shapes, hint, per_rank, layout, seed,
                            timeout=180)
    assert any(result["out_of_order"] for result in ranks), ranks  # the order was put to the test
    for rank, result in enumerate(ranks):
        assert result["bitwise"], f"rank {rank}: differs from the fixed order on the same data"
        assert result["error"] < 1e-12, f"rank {rank}: {result['error']} from the float64 model"


def variable_shape_that_breaks_the_model(rank: int, world_size: int) -> dict:
    """Microbatch 2's features do not fit the first stage's Linear: every rank must raise,
    promptly, naming the problem (rank 0) or the closed channel (the others)."""
    M = 2 * world_size
    chain = make_chain(world_size)
    stages, _ = build_stages(chain, rank, world_size, "loop")
    schedule = StudySchedule(stages, M, loss_fn=loss_fn, hint="1F1B",
                             settings=Settings(variable_shapes=True, stall_timeout=60),
                             study=Study(device=EmulatedDevice()))
    xs, ys = variable_batches(M, [3, 5, 4], seed=0)
    xs[2] = torch.randn(2, 4, DIM + 3, dtype=torch.float64)
    start = time.perf_counter()
    try:
        schedule.step(arg_mbs=[(x,) for x in xs] if rank == 0 else None,
                      target_mbs=ys if rank == world_size - 1 else None)
    except Exception as e:
        return {"error": error_chain(e), "elapsed": time.perf_counter() - start}
    return {"error": None}


def test_a_microbatch_whose_shape_breaks_the_model_fails_every_rank():
    ranks = run_local_world(2, variable_shape_that_breaks_the_model, timeout=120)
    assert "mat1 and mat2 shapes cannot be multiplied" in ranks[0]["error"], ranks[0]
    assert "global rank 0 of the pipeline failed" in ranks[1]["error"], ranks[1]
    assert all(r["elapsed"] < 20 for r in ranks)


class CountingGroup:
    """A channel's gloo group that records every send made on it: (bytes, dtype)."""

    def __init__(self, group: dist.ProcessGroup, sends: list):
        self._group, self._sends = group, sends

    def send(self, tensors, peer: int, tag: int) -> dist.Work:
        self._sends.extend((t.numel() * t.element_size(), t.dtype) for t in tensors)
        return self._group.send(tensors, peer, tag)

    def __getattr__(self, name):
        return getattr(self._group, name)


def messages_per_step(rank: int, world_size: int, variable: bool) -> dict:
    """What this rank sends in the second of two 1F1B steps of fixed-shape microbatches:
    counted on the channels' groups themselves (``CountingGroup``), and as the step's stats
    report it."""
    import functools

    from rrfp.comm.channels import create_channels, make_channel_group

    sends: list = []

    def counting(name, store, channel_rank, timeout, **naming):
        return CountingGroup(make_channel_group(name, store, channel_rank, timeout, **naming),
                             sends)

    M = 4
    chain = make_chain(world_size)
    x, y = make_batch(M)
    stages, _ = build_stages(chain, rank, world_size, "loop")
    schedule = StudySchedule(stages, M, loss_fn=loss_fn, hint="1F1B",
                             settings=Settings(variable_shapes=variable),
                             study=Study(channels=functools.partial(create_channels,
                                                                    group_factory=counting)))
    xs, ys = list(x.chunk(M)), list(y.chunk(M))
    for _ in range(2):
        sends.clear()  # the connection's token, then the first step's
        schedule.step(arg_mbs=[(t,) for t in xs] if rank == 0 else None,
                      target_mbs=ys if rank == world_size - 1 else None)
    schedule.close()
    stats = schedule.last_step_stats
    return {"counted": len(sends), "counted_bytes": sum(n for n, _ in sends),
            "headers": sum(1 for n, dtype in sends if dtype == torch.int64),
            "header_bytes": sorted({n for n, dtype in sends if dtype == torch.int64}),
            "reported": stats.messages_sent, "reported_bytes": stats.bytes_sent}


def test_fixed_shapes_send_no_header_and_variable_shapes_one_per_activation():
    """Sends counted on the channels' own groups: with fixed shapes only the tensors
    themselves; with variable shapes an 80-byte header (1 + 9 int64) ahead of each
    activation and none ahead of a gradient; the step's stats report the same."""
    message = BATCH_PER_MICROBATCH * DIM * 8  # one float64 tensor
    fixed = run_local_world(2, messages_per_step, False, timeout=180)
    variable = run_local_world(2, messages_per_step, True, timeout=180)
    for result in fixed + variable:
        assert result["reported"] == result["counted"], result
        assert result["reported_bytes"] == result["counted_bytes"], result
    # rank 0: 4 activations; rank 1: 4 gradients
    assert [(r["counted"], r["counted_bytes"], r["headers"]) for r in fixed] == [
        (4, 4 * message, 0), (4, 4 * message, 0)]
    assert [(r["counted"], r["counted_bytes"], r["headers"]) for r in variable] == [
        (8, 4 * message + 4 * 80, 4), (4, 4 * message, 0)]
    assert variable[0]["header_bytes"] == [80]


def test_variable_shapes_on_nccl_channels_send_their_headers_on_the_host():
    """On NCCL channels each channel gets a gloo side channel for the shape headers, so a
    header is read on the host, with no device-to-host copy per message: the (NCCL-like)
    data channels carry only the connection token and the payloads, never an int64
    header; results are bitwise the fixed order's on the same data."""
    ranks = run_local_world(2, variable_shapes, "1F1B", 1, "loop", 5, "nccl-like",
                            timeout=180)
    for rank, result in enumerate(ranks):
        assert result["bitwise"], f"rank {rank}: differs from the fixed order on the same data"
        assert result["error"] < 1e-12
        assert result["data_dtypes"] == ["torch.float32", "torch.float64"], result
