"""Split backward (I/W) on a user's kind of model: stages of Linear + ReLU layers whose first
layer saves the received activation itself. ScheduleRRFP at "hint" holds no more saved
activation bytes per rank than torch's own schedule class on the same torch, measured by a
byte meter that knows nothing of either (each world has a hard timeout)."""

from __future__ import annotations

import random

import pytest
import torch

from rrfp import ScheduleRRFP, Settings
from rrfp.core.hints import build_hint
from rrfp.testing.chains import build_stages, local_stage_indices, loss_fn, torch_schedule
from rrfp.testing.emulation import EmulatedDeviceTime
from rrfp.testing.probes import SavedTensorBytes
from rrfp.testing.worlds import run_local_world

WIDTH, ROWS_PER_STEP, MICROBATCHES, LAYERS_PER_STAGE = 16, 32, 8, 2
LAST_BACKWARD_SECONDS = 0.025
"""The last stage's backward per microbatch: upstream forwards run ahead meanwhile."""
OTHER_SECONDS = 0.003
"""Every other forward and backward: a seeded draw in [0, this)."""

# (hint, torch's class whose memory is the reference, placement); BFW's streams and memory
# reference are ZBVZeroBubble's (``build_hint``), so that class runs the same order.
SPLIT_BACKWARD_CASES = [
    ("InterleavedZeroBubble", "InterleavedZeroBubble", "loop"),
    ("ZBVZeroBubble", "ZBVZeroBubble", "v"),
    ("DualPipeV", "DualPipeV", "v"),
    ("BFW", "ZBVZeroBubble", "v"),
]


def relu_chain(num_stages: int) -> list[torch.nn.Module]:
    """Per stage an ``nn.Sequential`` of Linear + ReLU layers, float64; the model's last
    layer without its ReLU."""
    torch.manual_seed(0)
    chain = []
    for s in range(num_stages):
        layers: list[torch.nn.Module] = []
        for layer in range(LAYERS_PER_STAGE):
            layers.append(torch.nn.Linear(WIDTH, WIDTH))
            if s < num_stages - 1 or layer < LAYERS_PER_STAGE - 1:
                layers.append(torch.nn.ReLU())
        chain.append(torch.nn.Sequential(*layers).double())
    return chain


def delayed(num_stages: int, meter: SavedTensorBytes):
    """A ``build_stages`` wrap: the stage module metered, then under emulated time: the
    last stage's backward ``LAST_BACKWARD_SECONDS`` per microbatch, everything else a
    seeded draw below ``OTHER_SECONDS``."""
    def wrap(s: int, block: torch.nn.Module) -> torch.nn.Module:
        meter.watch(block)
        draws = random.Random(s)
        forward = [draws.uniform(0, OTHER_SECONDS) for _ in range(MICROBATCHES)]
        backward = [LAST_BACKWARD_SECONDS if s == num_stages - 1
                    else draws.uniform(0, OTHER_SECONDS) for _ in range(MICROBATCHES)]
        return EmulatedDeviceTime(block, MICROBATCHES, forward.__getitem__, backward.__getitem__)
    return wrap


def peak_saved_bytes(rank: int, world_size: int, hint: str, reference: str,
                     layout: str) -> dict:
    """This rank's peak saved-activation bytes in a measured step (after a warm-up step)
    under torch's class ``reference`` and under ScheduleRRFP at "hint", and whether the
    two steps' gradients are bitwise equal."""
    num_stages = 2 * world_size
    chain = relu_chain(num_stages)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS_PER_STEP, WIDTH, generator=g, dtype=torch.float64)
    y = torch.randn(ROWS_PER_STEP, WIDTH, generator=g, dtype=torch.float64)
    inputs = (x,) if 0 in local_stage_indices(rank, world_size, num_stages, layout) else ()
    peaks: dict = {}
    grads = {}
    for name in ("torch", "rrfp"):
        meter = SavedTensorBytes()
        stages, blocks = build_stages(chain, rank, world_size, layout,
                                      wrap=delayed(num_stages, meter))
        schedule = torch_schedule(reference, stages, MICROBATCHES) if name == "torch" else (
            ScheduleRRFP(stages, MICROBATCHES, loss_fn=loss_fn, hint=hint,
                         settings=Settings(stall_timeout=60, meter_activations=False)))
        optimizer = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.01)
        for _ in range(2):  # a warm-up step (with shape inference), then the measured one
            optimizer.zero_grad(set_to_none=True)
            for stage in stages:
                stage.submod.reset()
            meter.reset_peak()
            schedule.step(*inputs, target=y, return_outputs=False)
            grads[name] = [p.grad.clone() for b in blocks for p in b.parameters()]
            optimizer.step()
        if name == "rrfp":
            schedule.close()
        peaks[name] = meter.peak
    peaks["bitwise"] = all(torch.equal(a, b) for a, b in zip(grads["torch"], grads["rrfp"]))
    return peaks


@pytest.mark.parametrize("case", SPLIT_BACKWARD_CASES, ids=lambda c: c[0])
def test_split_backward_on_relu_stages_holds_no_more_than_torch(case):
    """Every split-backward hint at "hint", 2 ranks, 8 microbatches, forwards let run ahead
    by a slow last stage: per rank, the peak bytes autograd holds for backward under
    ScheduleRRFP are at most those under torch's own class with the same order, and the
    gradients are bitwise that class's."""
    hint, reference, layout = case
    assert build_hint(hint, num_ranks=2, num_stages=4, n_microbatches=MICROBATCHES,
                      layout=layout).has_split_backward
    ranks = run_local_world(2, peak_saved_bytes, *case, timeout=120)
    print(f"{hint}: " + ", ".join(f"rank {r}: rrfp {p['rrfp']} B, torch {p['torch']} B"
                                  for r, p in enumerate(ranks)))
    for rank, peaks in enumerate(ranks):
        assert peaks["bitwise"], f"rank {rank}: gradients not bitwise torch's {reference}'s"
        assert peaks["torch"] > 0
        assert peaks["rrfp"] <= peaks["torch"], (
            f"rank {rank}: {peaks['rrfp']} B saved under RRFP at 'hint' ({hint}), "
            f"{peaks['torch']} B under torch's {reference} ({peaks['rrfp'] / peaks['torch']:.2f}x)")
