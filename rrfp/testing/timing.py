"""Timed stages and messages that force the orders a test needs: random emulated device
time per stage, random send delays, and messages made late on purpose."""

from __future__ import annotations

import random

from rrfp.core.actions import Edge
from rrfp.testing.emulation import EmulatedDeviceTime


def random_device_time(seed: int, stage: int, n_microbatches: int, max_s: float):
    """Wrapper factory: every forward/backward call sleeps a fresh random time."""
    rng = random.Random(seed * 1000 + stage)
    return lambda block: EmulatedDeviceTime(
        block, n_microbatches,
        forward_time=lambda mb: rng.uniform(0, max_s),
        backward_time=lambda mb: rng.uniform(0, max_s),
    )


def random_send_delay(seed: int, max_s: float,
                      late: dict[tuple[Edge, int], float] | None = None):
    """``send_delay`` for ScheduleRRFP: a fresh random delay per message; each message of
    ``late`` ((edge, microbatch) -> seconds) takes that much longer (and, a channel being
    FIFO, so do those after it on its edge)."""
    rng = random.Random(seed)
    late = late or {}

    def delay(edge: Edge, mb: int) -> float:
        return rng.uniform(0, max_s) + late.get((edge, mb), 0.0)
    return delay


LATE_S = 0.3
"""How much later a message made late to force an order arrives: about ten times what a
loaded machine (load 15 on 2 cores) adds to an action or a message (tens of milliseconds),
so that the work it lets pass is ready first whatever the scheduling noise."""


SECOND_ACTIVATION_LATE = {(Edge(0, 1), 1): LATE_S}
"""``random_send_delay``'s ``late`` that makes actions run out of the hint's order: stage 1
waits for microbatch 1's activation (and, the channel being FIFO, for the later ones)
while other work is ready, on its rank or on stage 0's (forwards ahead of a backward whose
gradient waits on stage 1), at any limit with room for it; even where the hint leaves
none (LoopedBFS), a later stage's forward of microbatch 0 passes it (with more margin:
``ACROSS_BOTH_RANKS_LATE``)."""


ACROSS_BOTH_RANKS_LATE = {(Edge(0, 1), 1): 3 * LATE_S}
"""``SECOND_ACTIVATION_LATE`` for LoopedBFS, whose hint leaves stage 1 nothing else to run:
only stage 3's forward of microbatch 0 can pass it, and its input comes after five actions
and three messages across both ranks. With ``LATE_S`` a CI run (three lanes on 2 cores) once
saw no action pass it; 12 CPU-bound processes here did not reproduce that, so the cause is
not established, and this gives that chain three times the margin."""


def replicas_apart(hint: str, replica: int) -> dict[tuple[Edge, int], float]:
    """Late messages (``random_send_delay``'s ``late``) that make two data-parallel
    replicas of a 2-rank, 4-stage, 4-microbatch pipeline, readiness-first with memory for
    one microbatch more than the hint, run a pair of one pipeline rank's actions in
    opposite orders. Interleaved1F1B: pipeline rank 1's hint runs 1B1, then 3F2, whose
    input rank 0 sends right after 1B1's gradient; replica 0 gets 3F2's input late (1B1
    runs first), replica 1 1B1's gradient (3F2 runs first). ZBVZeroBubble: the same with
    0I0, then 3F2, on pipeline rank 0."""
    keeps_order, reverses_it = {
        "Interleaved1F1B": ((Edge(2, 3), 2), (Edge(2, 1), 1)),
        "ZBVZeroBubble": ((Edge(2, 3), 2), (Edge(1, 0), 0)),
    }[hint]
    return {(keeps_order, reverses_it)[replica]: LATE_S}
