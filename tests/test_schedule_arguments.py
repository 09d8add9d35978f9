"""The arguments torch's runtime schedules take that torchtitan's main branch passes to a
multi-stage schedule class (``max_active_stages``, ``unshard_lookahead``, with
``scale_grads`` and ``backward_requires_autograd``), ``defer_pp_recv``, and torch's
per-edge P2P groups: ScheduleRRFP built as torchtitan builds torch's classes runs bitwise
as torch's Interleaved1F1B given the same arguments; what it cannot do is refused in one
line at construction, before anything communicates."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed.config as distributed_config
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import (FORWARD, FULL_BACKWARD,
                                                    ScheduleInterleaved1F1B)

from rrfp import ScheduleRRFP
from rrfp.runtime.schedule_arguments import TorchScheduleArguments
from rrfp.testing.callbacks import torch_style_callbacks
from rrfp.testing.chains import (bitwise_equal, build_stages, loss_fn, make_batch, make_chain,
                                 run_steps)
from rrfp.testing.worlds import run_local_world

M = 4
TITAN_MAIN = dict(scale_grads=False, backward_requires_autograd=True, max_active_stages=2,
                  unshard_lookahead="auto")
"""What torchtitan's main branch passes a multi-stage schedule class besides the stages,
``n_microbatches`` and ``loss_fn``, at its defaults with 2 stages per rank
(``pp_max_unsharded_active_stages`` None: the local stages; lookahead ``"auto"``)."""
PER_EDGE = hasattr(distributed_config, "pipeline_per_edge_p2p")


def _torch_takes(kwargs: dict) -> dict:
    """The ones of ``kwargs`` this torch's Interleaved1F1B takes (2.13 has no residency
    window or lookahead argument)."""
    taken = inspect.signature(ScheduleInterleaved1F1B).parameters
    return {name: value for name, value in kwargs.items() if name in taken}


def _both(rank: int, world_size: int, kwargs: dict, step) -> bool:
    """torch's Interleaved1F1B and ScheduleRRFP, each built with ``kwargs`` and run by
    ``step(schedule, stages, blocks)``: whether their gradients and losses are bitwise
    the same."""
    chain = make_chain(2 * world_size)
    histories = []
    for build in (lambda s: ScheduleInterleaved1F1B(s, n_microbatches=M, loss_fn=loss_fn,
                                                    **_torch_takes(kwargs)),
                  lambda s: ScheduleRRFP(s, n_microbatches=M, loss_fn=loss_fn, **kwargs)):
        stages, blocks = build_stages(chain, rank, world_size, "loop")
        schedule = build(stages)
        histories.append(step(schedule, stages, blocks))
        if isinstance(schedule, ScheduleRRFP):
            schedule.close()
    return bitwise_equal(*histories)


def _two_steps(schedule, stages, blocks):
    x, y = make_batch(M)
    return run_steps(schedule, stages, blocks, x, y, 2)


def _callbacks_without_autograd(schedule, stages, blocks):
    """Each action's compute in a FORWARD or FULL_BACKWARD callback that enables autograd
    itself (as a callback running its own backward would not need it): a step, then one
    under ``torch.no_grad()`` (torch's first-step shape inference needs autograd)."""
    forward, backward = torch_style_callbacks([])

    def with_grad(callback):
        def run(action, ctx):
            with torch.enable_grad():
                callback(action, ctx)
        return run

    schedule.register_custom_function(FORWARD, with_grad(forward))
    schedule.register_custom_function(FULL_BACKWARD, with_grad(backward))
    x, y = make_batch(M)
    history = run_steps(schedule, stages, blocks, x, y, 1)
    with torch.no_grad():
        return history + run_steps(schedule, stages, blocks, x, y, 1)


def titan_main_arguments(rank: int, world_size: int) -> dict:
    """ScheduleRRFP against torch's Interleaved1F1B: built with torchtitan main's
    arguments; with per-edge P2P groups (where torch has them); with
    ``backward_requires_autograd=False`` under ``no_grad`` (and True, refused there);
    and ``defer_pp_recv=True``, refused at construction."""
    result = {"titan_main": _both(rank, world_size, TITAN_MAIN, _two_steps)}
    if PER_EDGE:
        with distributed_config.patch(pipeline_per_edge_p2p=True):
            result["per_edge"] = _both(rank, world_size, {}, _two_steps)
    result["no_autograd"] = _both(rank, world_size, {"backward_requires_autograd": False},
                                  _callbacks_without_autograd)
    refused = {}
    for name, kwargs in (("needs_autograd", {}), ("defer", {"defer_pp_recv": True})):
        stages, blocks = build_stages(make_chain(2 * world_size), rank, world_size, "loop")
        schedule = None
        try:
            schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, **kwargs)
            _callbacks_without_autograd(schedule, stages, blocks)
            refused[name] = None
        except (RuntimeError, ValueError) as e:
            refused[name] = f"{type(e).__name__}: {e}"
        finally:
            if schedule is not None:
                schedule.close()
    return {**result, **refused}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_local_world(2, titan_main_arguments, timeout=240)


def test_built_as_torchtitan_main_builds_a_schedule_it_runs_as_torchs(runs):
    assert all(run["titan_main"] for run in runs)


@pytest.mark.skipif(not PER_EDGE, reason="torch has no per-edge P2P groups")
def test_with_torchs_per_edge_p2p_groups_it_runs_as_torchs(runs):
    assert all(run["per_edge"] for run in runs)


def test_backward_requires_autograd_false_runs_under_no_grad_as_torchs(runs):
    assert all(run["no_autograd"] for run in runs)
    for run in runs:  # and by default, as torch's, a step under no_grad is refused
        assert run["needs_autograd"].startswith("RuntimeError: step() computes gradients")


def test_defer_pp_recv_is_refused_at_construction_in_one_line(runs):
    for run in runs:
        assert run["defer"].startswith("ValueError: defer_pp_recv=True posts each receive")
        assert "\n" not in run["defer"]


@pytest.mark.parametrize("arguments,stages", [
    (TorchScheduleArguments(), 2), (TorchScheduleArguments(2, "auto"), 2),
    (TorchScheduleArguments(3, "full"), 2), (TorchScheduleArguments(None, (2, 2)), 2),
    (TorchScheduleArguments(4, "auto"), 2)])
def test_values_that_mean_what_rrfp_does_are_accepted_with_fsdp(arguments, stages):
    arguments.check({0: stages, 1: stages}, fsdp=True)


@pytest.mark.parametrize("arguments,line", [
    (TorchScheduleArguments(1), "max_active_stages=1 keeps 1 of the 2 FSDP stages of "
                                "pipeline rank 0 unsharded; ScheduleRRFP unshards every"),
    (TorchScheduleArguments(2, (1, 2)), "unshard_lookahead=(1, 2) lets pipeline rank 0 "
                                        "start 1 of its 2 FSDP stages' all-gathers ahead"),
])
def test_a_smaller_fsdp_window_is_refused_in_one_line(arguments, line):
    with pytest.raises(ValueError) as refused:
        arguments.check({0: 2, 1: 2}, fsdp=True)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)
    arguments.check({0: 2, 1: 2}, fsdp=False)  # without FSDP nothing is gathered at all


def test_auto_is_refused_only_where_a_rank_holds_more_stages_than_it_looks_ahead():
    TorchScheduleArguments(4, "auto").check({0: 2, 1: 2}, fsdp=True)
    with pytest.raises(ValueError, match="'auto' lets pipeline rank 0 start 2 of its 4"):
        TorchScheduleArguments(4, "auto").check({0: 4, 1: 4}, fsdp=True)


@pytest.mark.parametrize("arguments,message", [
    (TorchScheduleArguments(0), "max_active_stages must be a positive integer"),
    (TorchScheduleArguments(2, "some"), "unshard_lookahead must be 'full', 'auto' or a tuple"),
    (TorchScheduleArguments(2, (2,)), "a tuple of 2 integers"),
    (TorchScheduleArguments(2, (2, 3)), r"unshard_lookahead\[1\] must be an integer within"),
])
def test_values_torch_refuses_are_refused_without_fsdp_too(arguments, message):
    with pytest.raises(ValueError, match=message):
        arguments.check({0: 2, 1: 2}, fsdp=False)


@pytest.mark.skipif(not hasattr(torch_schedules, "_resolve_unshard_lookahead"),
                    reason="this torch has no unshard lookahead")
@pytest.mark.parametrize("lookahead", ["full", "auto", (1, 3, 2, 3)])
@pytest.mark.parametrize("window", [1, 2, 3])
def test_lookahead_distances_are_torchs(lookahead, window):
    if isinstance(lookahead, tuple) and max(lookahead) > window:
        pytest.skip("a distance beyond the window (both refuse it)")
    arguments = TorchScheduleArguments(window, lookahead)
    ours = tuple(arguments.lookahead_of(rank, window, 4) for rank in range(4))
    assert ours == torch_schedules._resolve_unshard_lookahead(lookahead, 4, window)
