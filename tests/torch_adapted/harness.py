"""How torch's own pipelining tests run here.

torch runs them as methods of ``MultiProcContinuousTest`` on 2-4 GPUs with NCCL. Here each
test method runs on CPU/gloo in a world of processes
(``rrfp.testing.worlds.run_local_world``), once with torch's schedule class (``runtime="torch"``) and once with ``ScheduleRRFP`` given that
class as hint (``runtime="rrfp"``): the test body builds its schedule through
``RankCase.under_test``, the one line changed in each. As in torch's continuous test
classes, one world runs every selected case of a test class in sequence; a case passes when
it passed on every rank. Each case starts from ``torch.manual_seed(0)`` (what torch's test
modules do at import), so its inputs do not depend on which cases ran before it.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import time
import traceback
import unittest
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime, PipelineScheduleMulti

from rrfp import ScheduleRRFP, Settings
from rrfp.testing.worlds import run_local_world

RUNTIMES = ("torch", "rrfp")
STALL_TIMEOUT_S = 60.0
"""RRFP's stall timeout here: a hang becomes an error naming what waits, within a world's
timeout."""
CASE_SYNC_S = 150.0
"""How long a rank waits for the others to finish a case (longer than gloo's timeout in
``run_local_world``, which ends a rank stuck in a peer's failed case)."""
_LOADED_LATER = (PipelineScheduleMulti, _PipelineScheduleRuntime)
"""torch's base classes, which a test loads with actions after construction: ScheduleRRFP
starts from the placement's default hint and takes those actions as its hint."""


@dataclass(frozen=True)
class Case:
    """One test method with one set of parameters, on one runtime."""

    test: str
    params: tuple[tuple[str, object], ...]
    runtime: str

    @property
    def id(self) -> str:
        described = ",".join(_describe(value) if name[0].isupper() or name.endswith("class")
                             else f"{name}={_describe(value)}" for name, value in self.params)
        return f"{self.test}[{described}]-{self.runtime}"


def _describe(value: object) -> str:
    return value.__name__.removeprefix("Schedule") if isinstance(value, type) else str(value)


def cases(test: str, **grid: list) -> list[Case]:
    """``test`` on both runtimes with every combination of the parameter values in ``grid``."""
    names = list(grid)
    return [Case(test, tuple(zip(names, values)), runtime)
            for values in itertools.product(*grid.values()) for runtime in RUNTIMES]


def params(found: list[Case], failing: dict[str, str], quick: set[str]) -> list:
    """pytest parameters for ``found``. The ids in ``failing`` are expected to fail, for
    the reason given (strict: a pass is reported); those not in ``quick`` are marked
    ``torch_suite`` (left out of the default run, run by ``.ci/run``)."""
    unknown = (set(failing) | quick) - {case.id for case in found}
    if unknown:
        raise ValueError(f"no case has the ids {sorted(unknown)}")
    return [pytest.param(case, id=case.id, marks=[
        *([pytest.mark.xfail(strict=True, reason=failing[case.id])] if case.id in failing else []),
        *([] if case.id in quick else [pytest.mark.torch_suite])]) for case in found]


def ids(test: str, *params: str) -> set[str]:
    """The ids of ``test`` with each of ``params`` (as in a case id), on both runtimes."""
    return {f"{test}[{p}]-{runtime}" for p in params for runtime in RUNTIMES}


class RankCase(unittest.TestCase):
    """What a torch test method reads from its test class, on one rank of a world."""

    __test__ = False  # run by ``run_rank`` in a world, not collected by pytest
    world_size = 2

    def __init__(self, rank: int, world_size: int, runtime: str) -> None:
        super().__init__()
        self.rank = rank
        self.world_size = world_size
        self.runtime = runtime
        self.schedules: list[ScheduleRRFP] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def under_test(self, ScheduleClass: type) -> Callable:  # noqa: N803 (torch's name)
        """What builds the case's schedule: ``ScheduleClass`` itself, or ScheduleRRFP with
        it as hint (same arguments)."""
        if self.runtime == "torch":
            return ScheduleClass
        hint = None if ScheduleClass in _LOADED_LATER else ScheduleClass

        def build(stages, n_microbatches, *args, **kwargs) -> ScheduleRRFP:
            schedule = ScheduleRRFP(stages, n_microbatches, *args, hint=hint,
                                    settings=Settings(stall_timeout=STALL_TIMEOUT_S), **kwargs)
            self.schedules.append(schedule)
            return schedule
        return build

    def close_schedules(self) -> None:
        for schedule in self.schedules:
            schedule.close()


@contextlib.contextmanager
def check_leaked_tensors() -> Iterator[list]:
    """torch's ``common_utils.check_leaked_tensors`` (whose module needs ``expecttest``):
    yields the tensors that the wrapped code left in reference cycles."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    garbage: list = []
    try:
        yield garbage
        gc.collect()
        garbage.extend(obj for obj in gc.garbage if isinstance(obj, torch.Tensor))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@dataclass(frozen=True)
class Outcome:
    tracebacks: dict[int, str]
    """Per failing rank, its traceback."""
    seconds: float
    """The slowest rank's time for the case."""

    def check(self) -> None:
        if self.tracebacks:
            raise AssertionError("\n".join(f"--- rank {rank} ---\n{tb}"
                                           for rank, tb in sorted(self.tracebacks.items())))


def run_rank(rank: int, world_size: int, case_class: type[RankCase],
             found: list[Case]) -> list[tuple[str, float]]:
    """The cases on this rank, in order, up to the first that failed on any rank: per case
    its traceback ("" if it passed here) and time.

    A failed case can leave the world's process group unusable (a peer timed out in a
    receive), so the world ends there: a rank that failed returns at once, which closes
    its gloo connections and so ends its peers' waits for it, and ``run_worlds`` goes on
    in a fresh world.
    """
    store = dist.distributed_c10d._get_default_store()
    outcomes = []
    for index, case in enumerate(found):
        torch.manual_seed(0)
        test = case_class(rank, world_size, case.runtime)
        start = time.perf_counter()
        failure = ""
        try:
            getattr(test, case.test)(**dict(case.params))
        except BaseException:
            failure = traceback.format_exc()
        try:
            test.close_schedules()
        except BaseException:
            failure += traceback.format_exc()
        outcomes.append((failure, time.perf_counter() - start))
        # Keyed by the case, so a case that failed on one rank cannot pair its barrier
        # with another case's.
        keys = [f"torch_adapted/{index}/{r}" for r in range(world_size)]
        store.set(keys[rank], "failed" if failure else "passed")
        if failure:
            break
        store.wait(keys, datetime.timedelta(seconds=CASE_SYNC_S))
        if any(said == b"failed" for said in store.multi_get(keys)):
            break
    return outcomes


def run_worlds(request: pytest.FixtureRequest, worlds: dict[type[RankCase], int],
               timeout: float) -> dict[str, Outcome]:
    """Run the module's selected cases, in worlds of each test class's size (``worlds``),
    a fresh world after each failed case; their outcomes by case id."""
    selected = [item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]
    outcomes: dict[str, Outcome] = {}
    for case_class, world_size in worlds.items():
        left = [case for case in selected if hasattr(case_class, case.test)]
        while left:
            ranks = run_local_world(world_size, run_rank, case_class, left, timeout=timeout)
            ran = min(len(result) for result in ranks)
            for index, case in enumerate(left[:ran]):
                outcomes[case.id] = Outcome(
                    {rank: result[index][0] for rank, result in enumerate(ranks)
                     if result[index][0]},
                    max(result[index][1] for result in ranks))
            left = left[ran:]
    return outcomes


def run_here(case_class: type[RankCase], case: Case) -> None:
    """Run a single-process ``case`` in this process, as torch runs those; then close its
    schedules and end a process group it left initialized (a failed case does)."""
    torch.manual_seed(0)
    test = case_class(0, 1, case.runtime)
    try:
        getattr(test, case.test)(**dict(case.params))
    finally:
        try:
            test.close_schedules()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
