"""Microbatch sizes at run time (``ScheduleRRFP.step(mb_sizes=...)``): checked before the
step communicates, fitted from measured device durations, the fits shared through the
store, the gradients still torch's fixed schedule's (each world has a hard timeout)."""

from __future__ import annotations

import math

from rrfp import ScheduleRRFP
from rrfp.comm.fit_sharing import decode_fits, encode_fits
from rrfp.core.sizes import DurationFit
from rrfp.testing.chains import build_stages, loss_fn, make_batch, make_chain
from rrfp.testing.sized_world import BACKWARD_PER_FORWARD, sized_steps, TOKENS
from rrfp.testing.worlds import run_local_world


def test_fits_travel_through_the_store_exactly():
    fits = {(0, "F"): DurationFit(0.1, 0.01, (1e-4, 3e-9, 0.0)),
            (3, "B"): DurationFit(2 / 3, math.pi, (0.0, 0.0, 0.0))}
    assert decode_fits(encode_fits(fits)) == fits


def test_sized_steps_share_fits_predict_by_size_and_keep_torchs_gradients():
    # 1F1B, 4 ranks, 8 microbatches, hint+2, emulated device time proportional to each
    # microbatch's tokens on every stage (5 ms a token: a fast test; the speed comparison
    # is benchmarks/sizes_ab.py's).
    unit_s = 0.005
    ranks = run_local_world(4, sized_steps, 1, unit_s, timeout=300)
    for rank, result in enumerate(ranks):
        assert result["bitwise"], f"rank {rank}: gradients differ from torch's 1F1B"
        # Every stage's F and B fitted: its own measured, the others' from the store.
        assert result["fits"] == [(s, k) for s in range(4) for k in ("B", "F")]
        # Each (stage, kind)'s prediction grows with the tokens; the heaviest microbatch's
        # is about its emulated time (a sleep: never shorter, longer by what a loaded
        # machine adds to a sleep; 50 ms more seen at load 5-8).
        predicted = result["predicted"]
        light, heavy = TOKENS.index(min(TOKENS)), TOKENS.index(max(TOKENS))
        for s, kind in result["fits"]:
            emulated = unit_s * TOKENS[heavy] * (BACKWARD_PER_FORWARD if kind == "B" else 1)
            assert predicted[s, kind, light] < predicted[s, kind, heavy], (rank, s, kind)
            assert 0.8 * emulated <= predicted[s, kind, heavy] <= 1.5 * emulated + 0.1, (
                rank, s, kind, predicted[s, kind, heavy])
        # The stats' prediction error, per stage of the rank, where sizes were given (its
        # arithmetic: tests/test_sizes.py; here the sleeps' overshoot sets its value).
        errors = result["prediction_error"]
        assert list(errors["sizes"]) == [rank] and math.isfinite(errors["sizes"][rank]), errors
        assert errors["no sizes"] is None
        # A store write and a read of the others' fits per sized step.
        assert 0 < result["sharing_s"] < 0.05 * result["sized_steps"], result["sharing_s"]


BAD_SIZES = {
    "wrong_length": ([1.0] * 3, "mb_sizes has 3 entries for 4 microbatches"),
    "negative": ([1.0, -2.0, 1.0, 1.0], "mb_sizes[1]: microbatch size tokens=-2.0"),
    "nan": ([1.0, 1.0, float("nan"), 1.0], "mb_sizes[2]: microbatch size tokens=nan"),
    "infinite": ([math.inf, 1.0, 1.0, 1.0], "mb_sizes[0]: microbatch size tokens=inf"),
}


def bad_sizes(rank: int, world_size: int, case: str) -> str:
    """Every rank calls ``step`` with the same bad sizes: each must raise before it
    communicates (else a peer would wait forever); then a good step runs."""
    chain = make_chain(world_size)
    x, y = make_batch(4)
    stages, _ = build_stages(chain, rank, world_size, "loop")
    schedule = ScheduleRRFP(stages, 4, loss_fn=loss_fn, hint="1F1B")
    inputs = (x,) if rank == 0 else ()
    try:
        schedule.step(*inputs, target=y, mb_sizes=BAD_SIZES[case][0])
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError(f"no ValueError for {case}")
    schedule.step(*inputs, target=y, mb_sizes=[1, 2, 3, None])
    schedule.close()
    return message


def test_bad_sizes_raise_value_error_on_every_rank_before_any_communication():
    # One world for every case: a rank that communicated before raising would leave its
    # peer's good step waiting (the world's timeout), or mismatch its messages.
    for case, (_, expected) in BAD_SIZES.items():
        for message in run_local_world(2, bad_sizes, case, timeout=120):
            assert expected in message, (case, message)
