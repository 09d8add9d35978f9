"""Self-driving RRFP in a job: one rank decides, every rank runs its decision at the same step.

``Settings(tune_within=budget)`` hands the choice of ``buffer_limit`` and policy to
``rrfp.core.tuning.Tuner`` within a memory budget. The job's first rank runs the tuner; the
other ranks follow it. Steps go in blocks (``TuningRules.block``): at a block's first
training step the deciding rank says the block's plan under a key of the job's board,
and every rank reads it there (one wait on one key per rank and block: the control plane
stays constant per rank). A plan says, for each step of the block, the setting and whether
it is the in-run A/B's fixed-order step, and whether the ranks of the deciding rank's
pipeline share the steps' traces (while the tuner measures). The deciding rank collects
those traces at the next block, predicts every candidate from them in a process of its
own at ``nice 19``, started once and kept (``rrfp.advise.tuning.PredictionProcess``: the
advisor's own replay), and hands the predictions to the tuner when they are ready;
training never waits on a prediction. A prediction starts only where its expected CPU
fits, with every earlier one's, in the share of the host's CPU since the first step that
predictions may take (``rrfp.advise.cost.CpuBudget``); until then the running setting
goes on, checked by the in-run A/B. The deciding rank
deletes each trace once it read it, and each block's plan two blocks later (every rank
read it by then: the job's ranks meet in each step's collectives), so the keys the mode
leaves in the store do not grow with the steps.

Candidates are the microbatch limits from the hint's own up to the budget (``"hint+k"``;
a byte budget or ``"busiest"``: the largest ``"hint+k"`` whose worst mix of microbatches,
at the first step's measured bytes per microbatch, fits every rank's budget), each under
the default policy and the advisor's named ones; where the measured steps were given
microbatch sizes that tell microbatches apart, a policy that reads sizes is a candidate
told them and one not told them (``Candidate.use_sizes``: the steps of a setting without
them do not tell the policy the sizes they are given). With ``Settings.tune_hints``, each
interchangeable hint (``rrfp.core.hints.interchangeable_hints``) ranking at each of those
limits, counted on the run's hint, under its default policy is a candidate too
(``Candidate.hint``; a step of it builds a ``LimitPlan`` ``ranked_by`` that hint; the A/B's
steps run the run's own hint's fixed order). A budget below what the fixed
schedule itself holds raises one ``ValueError`` on every rank at the first block's end,
before any setting but the hint's own ran.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

from rrfp.advise import run_from_trace_events
from rrfp.advise.cost import CpuBudget
from rrfp.advise.measured import MeasuredRun
from rrfp.advise.tuning import PredictionProcess
from rrfp.comm.board import FailureBoard, JobScope
from rrfp.core.errors import PipelineStallError
from rrfp.core.hints import Hint
from rrfp.core.limits import fixed_peak_bytes, most_bytes_allowed, resolve_buffer_limits
from rrfp.core.settings import BufferLimit
from rrfp.core.sizes import StepSizes
from rrfp.core.stats import StepStats
from rrfp.core.text import counted
from rrfp.core.tuning import (Candidate, Decision, FIXED_ORDER, Predicted, StepRun, Tuner,
                              TuningRules)
from rrfp.runtime.limit_plan import LimitPlan

logger = logging.getLogger(__name__)

Predictor = Callable[[MeasuredRun, Sequence[str], Sequence[str]], list[Predicted]]
"""Each candidate's predicted speedup from a run's measured steps, at these limits, with
these interchangeable hints (``predict_candidates``' arguments)."""
PLAN = "tune/plan"
TRACE = "tune/trace"


@dataclass(frozen=True)
class BlockPlan:
    """What the deciding rank tells every rank for one block of steps."""

    runs: tuple[tuple[str, str | None, bool, str | None, bool], ...]
    """Per step: (buffer_limit, policy, whether the policy is told the step's sizes, the
    interchangeable hint that ranks (None: the run's own), an A/B fixed-order step)."""
    share: bool
    """The ranks of the deciding rank's pipeline share each step's trace."""
    decisions: tuple[str, ...] = ()
    """The decisions that took effect since the last plan, one line each."""
    error: str | None = None
    """A ``ValueError`` every rank raises (a budget the fixed schedule does not fit)."""
    waiting: str | None = None
    """Why a wanted prediction has not started (its CPU share), said once per prediction."""

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def decode(text: str) -> "BlockPlan":
        said = json.loads(text)
        return BlockPlan(tuple(tuple(run) for run in said["runs"]), said["share"],
                         tuple(said["decisions"]), said["error"], said["waiting"])


def told_sizes(sizes: StepSizes | None, run: StepRun | None) -> StepSizes | None:
    """The sizes a step's policy is told: those the step was given, unless the
    self-driving setting it runs (``run``; None: no self-driving) runs without them."""
    return sizes if run is None or run.setting.use_sizes else None


def candidate_limits(budget: BufferLimit, hint: Hint,
                     bytes_per_microbatch: Mapping[int, int] | None) -> list[str]:
    """The microbatch limits within ``budget``: ``"hint"`` to ``"hint+k"``. ``ValueError``
    where even the hint's own peaks exceed a byte budget."""
    if not budget.in_bytes:
        top = resolve_buffer_limits(budget, hint)
        own = resolve_buffer_limits("hint", hint)
        extra = max(top.per_rank[r] - own.per_rank[r] for r in own.per_rank)
        return ["hint", *(f"hint+{k}" for k in range(1, extra + 1))]
    assert bytes_per_microbatch is not None
    fixed = fixed_peak_bytes(hint, bytes_per_microbatch)
    budgets = (dict.fromkeys(fixed, max(fixed.values())) if budget.busiest
               else dict.fromkeys(fixed, budget.budget_bytes))
    short = {r: fixed[r] for r in fixed if fixed[r] > budgets[r]}
    if short:
        raise ValueError(
            f"tune_within={budget.spec!r}: the fixed schedule itself holds {short} B of "
            f"activations on pipeline ranks {sorted(short)}, above the budget "
            f"({budgets[min(short)]} B): give a budget of at least {max(short.values())} B")
    limits = []
    for k in range(0, hint.n_microbatches + 1):
        spec = f"hint+{k}" if k else "hint"
        resolved = resolve_buffer_limits(spec, hint)
        if any(most_bytes_allowed(resolved.per_stage, resolved.per_rank[r],
                                  bytes_per_microbatch, hint.stages_on(r)) > budgets[r]
               for r in fixed):
            break
        limits.append(spec)
    return limits


class SelfDriving:
    """One rank's part in a self-driving job (see the module docstring)."""

    def __init__(self, budget: BufferLimit, hint: Hint, rank: int, job: JobScope,
                 pipeline_ranks: Sequence[int], timeout: float,
                 rules: TuningRules = TuningRules(), predict_inline: Predictor | None = None,
                 cpu_budget: CpuBudget | None = None, hints: Mapping[str, Hint] | None = None,
                 process: PredictionProcess | None = None):
        self.budget, self.hint, self.rank = budget, hint, rank
        self.hints = dict(hints or {})
        """The interchangeable hints that may rank instead of ``hint``, by name
        (``Settings.tune_hints``; empty: none)."""
        self.timeout, self.rules = timeout, rules
        self.board = FailureBoard(None, job.me, job_store=job.store, job_ranks=job.ranks)
        self._alone = job.store is None or len(job.ranks) < 2
        """A job of one rank: nothing to tell."""
        self.leader = job.ranks[0] if job.ranks else job.me
        self.deciding = job.me == self.leader
        self.sharing = self.leader in pipeline_ranks
        self._pipeline_ranks = tuple(pipeline_ranks)
        self.tuner = Tuner(rules) if self.deciding else None
        self.decisions: list[str] = []
        """Every rank: the lines of the decisions that took effect so far."""
        self.waiting: str | None = None
        """Every rank: why the latest wanted prediction waited for its CPU share (None: none
        waited)."""
        self._waiting_note: str | None = None
        """The deciding rank: that line, for the next plan."""
        self._plan: BlockPlan | None = None
        self._told = 1
        """Decisions told to the ranks so far (the first, measuring, goes unsaid)."""
        self._limit_plans: dict[tuple[str, str | None, str | None], LimitPlan] = {}
        """Per (buffer_limit, policy, ranking hint): the limits a setting runs at."""
        self._running: LimitPlan | None = None
        """The limits of the setting of now (the A/B's steps aside)."""
        self._setting_since = 0
        """The training step from which the setting of now ran."""
        self._traces: dict[int, list[dict]] = {}
        self._built: tuple[tuple[int, ...], MeasuredRun] | None = None
        """The measured steps of the latest wanted prediction, and their run."""
        self._shared: list[int] = []
        self._limits: list[str] | None = None
        self._prediction: concurrent.futures.Future | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._predict_inline = predict_inline
        """Studies: predict in this process, at once (None: in ``process``, off the
        critical path)."""
        self._process = process if process is not None else PredictionProcess()
        self._budget = cpu_budget if cpu_budget is not None else CpuBudget()
        """The predictions' CPU, within a share of the host's since the first step."""
        self._predicting: tuple[int, bool] = (0, True)
        """The prediction in flight: the actions it predicts from, whether it starts the
        process."""
        self._waiting_for: range | None = None
        """The measured steps whose prediction waits for the CPU share (said once)."""

    def before_step(self, step: int) -> tuple[StepRun, LimitPlan]:
        """What training step ``step`` runs (read at a block's first step), and the limits
        it runs at (the hint's own, where it runs the fixed order)."""
        self._budget.start()
        block = self.rules.block
        if step % block == 0:
            self._plan = self._read_plan(step // block)
            if self._plan.error is not None:
                raise ValueError(self._plan.error)
            for line in self._plan.decisions:
                self.decisions.append(line)
                logger.info("rrfp self-driving: %s", line)
            if self._plan.waiting is not None:
                self.waiting = self._plan.waiting
                logger.info("rrfp self-driving: %s", self.waiting)
        assert self._plan is not None
        limit, policy, use_sizes, ranked_by, ab_fixed = self._plan.runs[step % block]
        run = StepRun(Candidate(limit, policy, use_sizes, ranked_by), ab_fixed)
        if run.setting == FIXED_ORDER or ab_fixed:
            return run, self._limit_plan("hint", None, None)
        plan = self._limit_plan(limit, policy, ranked_by)
        if plan is not self._running:
            self._running, self._setting_since = plan, step
        return run, plan

    def _limit_plan(self, limit: str, policy: str | None, ranked_by: str | None) -> LimitPlan:
        """The limits of a setting (the same told the sizes or not), made once."""
        plan = self._limit_plans.get((limit, policy, ranked_by))
        if plan is None:
            plan = LimitPlan(limit, self.hint, self.rank, policy,
                             None if ranked_by is None else self.hints[ranked_by])
            self._limit_plans[limit, policy, ranked_by] = plan
        return plan

    def meters(self, step: int) -> bool:
        """Whether training step ``step`` is the first of a new setting (metered: the meter
        costs CPU per saved tensor, so the other steps keep ``meter_every``)."""
        return step == self._setting_since

    def after_step(self, step: int, stats: StepStats) -> None:
        """Share the step's trace where the plan asks; the deciding rank observes it."""
        assert self._plan is not None
        if self._plan.share and self.sharing:
            self.board.tell(f"{TRACE}/{step}", json.dumps(stats.chrome_trace_events()),
                            job=True)
            self._shared.append(step)
        if self.tuner is not None:
            self.tuner.observe(self.tuner.next_run(), stats.step_time)

    def _read_plan(self, block: int) -> BlockPlan:
        key = f"{PLAN}/{block}"
        if self.tuner is not None and self._alone:
            return self._decide()
        if self.tuner is not None:
            self.board.tell(key, self._decide().encode(), job=True)
            if block >= 2:  # every rank read it: each finished a step of the block since
                self.board.forget(f"{PLAN}/{block - 2}", [self.leader], job=True)
        said = self.board.collect(key, 2 * self.timeout, job=True, ranks=[self.leader])
        if self.leader not in said:
            raise PipelineStallError(
                f"global rank {self.leader}, which decides the self-driving settings, said "
                f"no plan for block {block} within twice stall_timeout ({2 * self.timeout:g} s)")
        return BlockPlan.decode(said[self.leader])

    def _decide(self) -> BlockPlan:
        """The deciding rank: collect the shared traces, hand over ready predictions, start
        wanted ones, and plan the block."""
        tuner = self.tuner
        assert tuner is not None
        self._collect_traces()
        error = None
        try:
            self._predict()
        except ValueError as e:
            error = str(e)
        runs = tuple((run.setting.buffer_limit, run.setting.policy, run.setting.use_sizes,
                      run.setting.hint, run.ab_fixed) for run in tuner.plan_block())
        told, self._told = self._told, len(tuner.decisions)
        waiting, self._waiting_note = self._waiting_note, None
        return BlockPlan(runs, tuner.measuring,
                         tuple(d.line() for d in tuner.decisions[told:]), error, waiting)

    def _collect_traces(self) -> None:
        for step in self._shared:
            said = self.board.collect(f"{TRACE}/{step}", self.timeout, job=True,
                                      ranks=self._pipeline_ranks)
            self._traces[step] = [event for rank in sorted(said)
                                  for event in json.loads(said[rank])]
            self.board.forget(f"{TRACE}/{step}", self._pipeline_ranks, job=True)
        self._shared.clear()

    def _predict(self) -> None:
        tuner = self.tuner
        assert tuner is not None
        if self._prediction is not None and self._prediction.done():
            done, self._prediction = self._prediction, None
            self.hand_over(done)
        wanted = tuner.wants_predictions
        if wanted is None or self._prediction is not None:
            return
        for old in [s for s in self._traces if s < wanted.start]:
            del self._traces[old]  # measured for an earlier prediction
        steps = tuple(s for s in wanted if s in self._traces)
        if len(steps) < 2:
            return
        run = self._measured_run(steps)
        if self._limits is None:
            self._limits = candidate_limits(self.budget, self.hint, run.bytes_per_microbatch)
        hints = list(self.hints)
        starting = not self._process.started
        if self._predict_inline is not None:
            tuner.choose(self._predict_inline(run, self._limits, hints))
        elif self._budget.allows(run.actions, starting=starting):
            self._predicting = (run.actions, starting)
            self._prediction = self._executor().submit(self._process.predict, run,
                                                       self._limits, hints)
        elif self._waiting_for != wanted:
            self._waiting_for = wanted
            budget = self._budget
            self._waiting_note = (
                f"predicting from steps {wanted.start}-{wanted.stop - 1} waits for the CPU it "
                f"may take beside training ({budget.share:.0%} of the time of "
                f"{counted(budget.cores, 'core')} since the first step): it is expected to "
                f"take {budget.expected(run.actions, starting=starting):.1f} s, and "
                f"{budget.spent:.1f} s of the {budget.granted:.1f} s granted so far are "
                "taken; the running setting goes on meanwhile, checked by the in-run A/B")

    def _measured_run(self, steps: tuple[int, ...]) -> MeasuredRun:
        """The run of ``steps``' traces, built once: a prediction that waits for its CPU
        share reads it again at each block, inside a timed step."""
        if self._built is None or self._built[0] != steps:
            self._built = (steps, run_from_trace_events([self._traces[s] for s in steps],
                                                        "self-driving"))
        return self._built[1]

    def hand_over(self, done: concurrent.futures.Future) -> None:
        """The deciding rank: give the tuner a finished prediction; a failed one chooses
        nothing over the hint's own setting (the job goes on), said in a warning."""
        assert self.tuner is not None
        actions, starting = self._predicting
        try:
            predicted, cpu_seconds = done.result()
        except Exception as e:
            logger.warning("rrfp self-driving: the prediction failed, so nothing is chosen "
                           "over the hint's own setting: %s", e)
            predicted, cpu_seconds = [], self._budget.expected(actions, starting=starting)
        self._budget.spend(cpu_seconds, actions, starting=starting)
        if self.tuner.wants_predictions is not None:
            self.tuner.choose(predicted)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:  # a thread that waits on the process (the GIL is released)
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="rrfp-self-driving")
        return self._pool

    @property
    def label(self) -> str:
        """What the steps' stats say in place of the ``buffer_limit`` setting."""
        return f"tune_within={self.budget.spec!r}"

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._process.close()

    @property
    def last_decision(self) -> Decision | None:
        return self.tuner.decisions[-1] if self.tuner is not None else None
