"""Limits counted in bytes: ``buffer_limit="busiest"`` and a per-rank byte budget, turned
into microbatch limits from the first step's measured bytes per microbatch per stage."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

from rrfp import ScheduleRRFP, Settings
from rrfp.core.hints import build_hint
from rrfp.core.limits import fixed_peak_bytes, limits_within_bytes, resolve_buffer_limits
from rrfp.core.settings import parse_buffer_limit
from rrfp.devices.platform import free_device_bytes
from rrfp.testing.byte_limits_world import byte_limits_world, UNIT
from rrfp.testing.chains import (bitwise_equal, build_stages, loss_fn, make_batch, make_chain,
                                 run_steps, torch_schedule)
from rrfp.testing.probes import HookProbe
from rrfp.testing.worlds import run_local_world


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    """Torch's Schedule1F1B, and ScheduleRRFP at "busiest", at a 14 KiB budget and at a
    10 KiB budget, below what 1F1B itself holds on rank 1 (3 microbatches x 4 KiB): 4
    ranks, stages saving 2, 4, 2 and 2 KiB per microbatch, emulated device, 4 steps each.
    Policy "hint" (readiness-first in hint order), which runs forwards ahead wherever a
    limit lets it, and in the last step a late gradient that gives rank 0 the time to, so
    that the slack is used and the bounds are tested where they bind."""
    return run_local_world(4, functools.partial(byte_limits_world, late_gradient=True),
                           [("busiest", "hint"), ("14KiB", "hint"), ("10KiB", None)],
                           timeout=240)


def test_busiest_in_bytes_keeps_the_job_peak_where_stages_differ(four_ranks):
    """The busiest rank's activation bytes measured on the tensors (the meter, and
    recomputed from the realized order times each stage's known bytes) stay within what
    torch's 1F1B busiest rank holds (metered the same way on torch's schedule): rank 1,
    whose microbatches are twice as large, keeps its 1F1B peak (counting in microbatches
    would allow it 4, rank 0's, 8 KiB more than any rank held), the others take the
    headroom: 6 microbatches of 2 KiB."""
    fixed_busiest = max(r["fixed_bytes"] for r in four_ranks)
    assert [r["fixed_bytes"] for r in four_ranks] == [4 * UNIT, 6 * UNIT, 2 * UNIT, 1 * UNIT]
    runs = [r["busiest/hint"] for r in four_ranks]
    assert all(run["bitwise"] for run in runs)
    assert [run["per_microbatch"] for run in runs] == [{0: UNIT}, {1: 2 * UNIT}, {2: UNIT},
                                                       {3: UNIT}]
    assert [run["rank_limit"] for run in runs] == [6, 3, 6, 6]
    for rank, (result, run) in enumerate(zip(four_ranks, runs)):
        assert run["peak_bytes"] == run["held"] * result["per_microbatch"], (rank, run)
        assert run["limit_bytes"] <= run["busiest_bytes"] == fixed_busiest
    assert max(run["peak_bytes"] for run in runs) <= fixed_busiest
    assert runs[0]["held"] > four_ranks[0]["fixed_held"]  # rank 0 used its headroom


def test_a_byte_budget_keeps_every_rank_within_it(four_ranks):
    """14 KiB per rank: 7 microbatches of 2 KiB, 3 of stage 1's 4 KiB; every rank's
    measured peak within the budget."""
    runs = [r["14KiB/hint"] for r in four_ranks]
    assert [run["rank_limit"] for run in runs] == [7, 3, 7, 7]
    for rank, (result, run) in enumerate(zip(four_ranks, runs)):
        assert run["bitwise"], rank
        assert run["budget"] == 14 * 1024
        assert run["peak_bytes"] == run["held"] * result["per_microbatch"] <= 14 * 1024, run


def test_a_budget_below_the_fixed_schedules_own_peak_fails_on_every_rank(four_ranks):
    for result in four_ranks:
        error = result["10KiB/None"]["error"]
        assert "pipeline rank 1's activation budget is 10240 B" in error
        assert "itself holds 12288 B" in error


def test_limits_within_bytes_fill_the_budget_from_the_hints_peaks():
    """Interleaved1F1B on 2 ranks: where stage 0 saves 3x the others, rank 0 keeps its
    1F1B-like floor on stage 0 and the rank limit binds; with equal bytes the result is
    the microbatch 'busiest' limits."""
    hint = build_hint("Interleaved1F1B", num_ranks=2, num_stages=4, n_microbatches=8,
                      layout="loop")
    equal = {s: UNIT for s in range(4)}
    busiest = max(fixed_peak_bytes(hint, equal).values())
    derived = limits_within_bytes(hint, equal, {0: busiest, 1: busiest})
    assert derived.limits == resolve_buffer_limits("busiest", hint)
    assert derived.over_budget() == []
    uneven = {0: 3 * UNIT, 1: UNIT, 2: UNIT, 3: UNIT}
    fixed = fixed_peak_bytes(hint, uneven)
    derived = limits_within_bytes(hint, uneven, {0: fixed[0], 1: fixed[0]})
    assert derived.limits.per_stage[0] == hint.plan.stage_peaks[0]
    assert derived.limits.per_rank[0] == hint.plan.rank_peaks()[0]
    assert all(derived.allowed_bytes[r] <= fixed[0] for r in (0, 1))
    assert derived.limits.per_rank[1] > hint.plan.rank_peaks()[1]


def test_auto_reads_free_and_cached_memory_less_the_margin():
    """The CUDA query, through a fake of torch.cuda: 30 GiB free of 80, 4 GiB reserved of
    which 1 is allocated, 10% margin: 30 + 3 - 8 GiB."""
    gib = 1 << 30
    fake = SimpleNamespace(mem_get_info=lambda device: (30 * gib, 80 * gib),
                           memory_reserved=lambda device: 4 * gib,
                           memory_allocated=lambda device: 1 * gib)
    assert free_device_bytes("cuda:0", cuda=fake) == 25 * gib
    full = SimpleNamespace(mem_get_info=lambda device: (1 * gib, 80 * gib),
                           memory_reserved=lambda device: 0, memory_allocated=lambda device: 0)
    assert free_device_bytes("cuda:0", cuda=full) == 0


@pytest.mark.parametrize("text,nbytes", [("512MiB", 512 << 20), ("12 GiB", 12 << 30),
                                         ("1.5GB", 1_500_000_000), ("2048b", 2048)])
def test_byte_budgets_are_spelled_with_a_unit(text, nbytes):
    assert parse_buffer_limit(text).budget_bytes == nbytes


@pytest.mark.parametrize("text,message", [("12 Gibs", "unknown byte unit"),
                                          ("0MiB", "no bytes"), ("12G", "unknown byte unit")])
def test_byte_budget_errors_say_what_to_write(text, message):
    with pytest.raises(ValueError, match=message):
        parse_buffer_limit(text)


def sampled_meter(rank: int, world_size: int, meter_every: int, steps: int) -> dict:
    """1F1B with the meter sampled every ``meter_every`` steps (the default schedule
    otherwise): per step, whether the forwards ran under saved-tensor hooks (``HookProbe``)
    and the stats' bytes; and whether the gradients are bitwise torch's Schedule1F1B."""
    M = 4
    chain = make_chain(world_size)
    x, y = make_batch(M)
    stages, blocks = build_stages(chain, rank, world_size, "loop")
    fixed = run_steps(torch_schedule("1F1B", stages, M), stages, blocks, x, y, steps)
    stages, blocks = build_stages(chain, rank, world_size, "loop", wrap=lambda s, b: HookProbe(b))
    schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="1F1B",
                            settings=Settings(stall_timeout=60, meter_every=meter_every))
    per_step, history = [], []
    for _ in range(steps):
        before = sum(len(stage.submod.hooked) for stage in stages)
        history += run_steps(schedule, stages, blocks, x, y, 1)
        hooked = [h for stage in stages for h in stage.submod.hooked][before:]
        stats = schedule.last_step_stats
        per_step.append({"hooked": sum(hooked), "forwards": len(hooked),
                         "bytes": stats.peak_activation_bytes,
                         "per_microbatch": stats.activation_bytes_per_microbatch})
    schedule.close()
    return {"steps": per_step, "bitwise": bitwise_equal(history, fixed)}


def test_the_meter_runs_in_the_first_step_and_every_nth_and_hooks_nothing_between():
    """meter_every=3 over 5 steps: steps 1 and 4 (0 and 3 counted from 0) run their
    forwards under the meter's saved-tensor hooks and report bytes; the others run
    autograd's saving untouched, report no peak, and keep the last metered bytes per
    microbatch. Gradients bitwise torch's 1F1B throughout."""
    ranks = run_local_world(2, sampled_meter, 3, 5, timeout=120)
    for rank, result in enumerate(ranks):
        assert result["bitwise"], rank
        steps = result["steps"]
        metered = [step["bytes"] is not None for step in steps]
        assert metered == [True, False, False, True, False], (rank, steps)
        for step, is_metered in zip(steps, metered):
            # 4 microbatches a step (the first step's shape inference runs unhooked)
            assert step["hooked"] == (4 if is_metered else 0), (rank, steps)
            assert step["per_microbatch"] == steps[0]["per_microbatch"]
        assert all(b > 0 for b in steps[0]["per_microbatch"].values())


def refused_settings(rank: int, world_size: int) -> dict[str, str]:
    """The ``ValueError`` of each byte setting ScheduleRRFP refuses on CPU stages."""
    stages, _ = build_stages(make_chain(world_size), rank, world_size, "loop")
    errors = {}
    for name, kwargs in {"auto on CPU": dict(buffer_limit="auto"),
                         "busiest unmetered": dict(buffer_limit="busiest",
                                                   meter_activations=False),
                         "meter_every 0": dict(meter_every=0)}.items():
        try:
            ScheduleRRFP(stages, 4, loss_fn=loss_fn, hint="1F1B",
                         settings=Settings(**kwargs)).close()
        except ValueError as e:
            errors[name] = str(e)
    return errors


def test_settings_that_cannot_work_are_refused_with_what_to_change():
    errors = run_local_world(2, refused_settings, timeout=180)[0]
    assert "reads the free memory of a CUDA device" in errors["auto on CPU"]
    assert "'512MiB'" in errors["auto on CPU"]
    assert "leave meter_activations on" in errors["busiest unmetered"]
    assert "meter_every must be an int >= 1" in errors["meter_every 0"]
    hint = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=4, layout="loop")
    with pytest.raises(ValueError, match="needs? measured bytes|only from the bytes"):
        resolve_buffer_limits("512MiB", hint)
