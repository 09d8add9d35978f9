"""ScheduleRRFP's step statistics next to torchtitan's metrics: a short console line,
TensorBoard scalars ``rrfp/<metric>/<rank label>`` (every metric; per stage, the error of
the durations predicted from microbatch sizes, ``rrfp/size_prediction_error/stage<n>``;
self-driving, the setting each step ran, ``rrfp/self_driving/...``) and Perfetto traces,
at each metrics step; and on the rank that logs the loss, the advisor's verdict, the
in-run A/B, the self-driving decisions and the end-of-run summary
(``torchtitan_ext.common.run_advice``)."""

from __future__ import annotations

import functools
import itertools
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import torch.distributed as dist
from torchtitan.tools.logging import logger

from rrfp import ScheduleRRFP, StepStats, write_chrome_trace
from rrfp.comm.store_keys import attempt_prefix
from torchtitan_ext.common.log_ranks import log_ranks
from torchtitan_ext.common.run_advice import RunAdvice


@dataclass(frozen=True)
class Metric:
    """One statistic of a rank's step, logged to TensorBoard and, where it has a console
    field, to the console line."""

    name: str
    """TensorBoard tag: ``rrfp/<name>/<rank label>``."""
    value: Callable[[StepStats], float | None]
    """Reads it off the rank's ``StepStats`` (public fields only); None: not measured
    (then left out of both)."""
    console: str | None = None
    """Its field in the console line, a ``str.format`` pattern of the value; None:
    TensorBoard only (the line stays short enough to scan)."""

    def show(self, stats: StepStats) -> str | None:
        value = self.value(stats)
        return None if value is None or self.console is None else self.console.format(value)


METRICS: tuple[Metric, ...] = (
    Metric("idle_fraction", lambda s: s.idle_fraction, "idle {:.0%}"),
    Metric("out_of_hint_order", lambda s: s.out_of_hint_order, "out-of-hint {}"),
    Metric("peak_in_flight", lambda s: s.peak_rank_in_flight, "held {}"),
    Metric("peak_activation_bytes", lambda s: s.peak_activation_bytes),
    Metric("peak_activation_mib",
           lambda s: None if s.peak_activation_bytes is None else s.peak_activation_bytes / 2**20,
           "activations {:.1f} MiB"),
    Metric("backpressure_entries", lambda s: sum(s.backpressure_entries.values())),
    Metric("receive_buffer_bytes", lambda s: s.receive_buffer_bytes),
    Metric("dispatch_overhead_us", lambda s: s.overhead_per_action * 1e6),
)


def size_error_field(stats: StepStats) -> list[str]:
    """The console's word on the durations predicted from the microbatch sizes: the worst
    of the rank's stages (TensorBoard has each stage's, ``rrfp/size_prediction_error``)."""
    errors = stats.size_prediction_error
    return [f"size-predicted ±{max(errors.values()):.0%}"] if errors else []


def self_driving_scalars(gathered: list[StepStats],
                         label: Callable[[StepStats], str]) -> dict[str, float]:
    """What a self-driving step ran (``rrfp.tune_within``), as TensorBoard scalars:
    ``rrfp/self_driving/fixed_order`` (1: the hint's fixed order, the in-run A/B's step or
    the fixed schedule chosen; else 0), ``rrfp/self_driving/other_hint`` (1: an
    interchangeable hint ranked the step, ``rrfp.tune_hints``; else 0) and, per rank, the
    microbatches of activations its stages might hold together,
    ``rrfp/self_driving/rank_buffer_limit/<rank label>``."""
    scalars = {"rrfp/self_driving/fixed_order": float(gathered[0].policy == "fixed"),
               "rrfp/self_driving/other_hint": float(gathered[0].ranked_by is not None)}
    for stats in gathered:
        if stats.rank_buffer_limit is not None:
            scalars[f"rrfp/self_driving/rank_buffer_limit/{label(stats)}"] = float(
                stats.rank_buffer_limit)
    return scalars


def stats_store(ranks: list[int], log: int) -> dist.PrefixStore:
    """Where the pipeline of ``ranks`` exchanges its stats for a process's ``log``-th
    ``StepStatsLog``: the job's store, under a prefix of their own (in this torchrun
    attempt's, ``rrfp.comm.store_keys.attempt_prefix``)."""
    return dist.PrefixStore(f"{attempt_prefix()}stats/{'-'.join(map(str, ranks))}/{log}/",
                            dist.distributed_c10d._get_default_store())


class StepStatsLog:
    """Logs ``last_step_stats`` of every rank of this rank's pipeline.

    Every rank of the pipeline group must call :meth:`log` at the same steps: each posts
    its stats to the job's store, and the ranks that ``read`` gather them all (the rank
    that writes TensorBoard and the ranks that print).
    """

    _logs = itertools.count()
    """Numbers the logs of a process (every rank creates them in the same order), so that a
    later one never reads an earlier one's keys."""

    def __init__(self, schedule: ScheduleRRFP, pp_group: dist.ProcessGroup, *,
                 replica: int | None, log_stats: bool, trace_folder: str | None,
                 reads: bool = True, self_driving: bool = False):
        """``replica``: this pipeline's data-parallel index (None without data parallelism),
        shown in labels as ``dp<replica>/pp<rank>``; ``trace_folder``: where this rank writes
        ``step<N>.json`` (None: it writes no traces); ``reads``: whether this rank gathers
        the pipeline's stats (False: it only posts its own, and logs nothing);
        ``self_driving``: ``rrfp.tune_within`` is set (the setting each step ran goes to
        TensorBoard too: ``self_driving_scalars``)."""
        self.self_driving = self_driving
        self.advice: RunAdvice | None = None
        """The run's verdict, A/B and summary, on the rank that logs the loss."""
        self.schedule = schedule
        self.pp_group = pp_group
        self.reads = reads
        ranks = dist.get_process_group_ranks(pp_group)
        self._store = stats_store(ranks, next(self._logs))
        self._posted: str | None = None
        self.replica = replica
        self.log_stats = log_stats
        self.trace_folder = trace_folder
        if trace_folder:
            logger.info(f"rrfp: Perfetto traces of each metrics step go to {trace_folder}")

    def label(self, stats: StepStats) -> str:
        return self._in_replica(f"pp{stats.pp_rank}")

    def stage_label(self, stage: int) -> str:
        return self._in_replica(f"stage{stage}")

    def _in_replica(self, name: str) -> str:
        return name if self.replica is None else f"dp{self.replica}/{name}"

    def log(self, step: int) -> dict[str, float]:
        """Post this rank's stats of the last step; a rank that reads also gathers the
        pipeline's, logs the console line and writes the trace. Returns the TensorBoard
        scalars (none where it does not read)."""
        gathered = self._exchange(step)
        if gathered is None:
            return {}
        scalars: dict[str, float] = {}
        line = []
        if self.log_stats:
            for stats in gathered:
                for metric in METRICS:
                    value = metric.value(stats)
                    if value is not None:
                        scalars[f"rrfp/{metric.name}/{self.label(stats)}"] = value
                errors = stats.size_prediction_error or {}
                for stage, error in errors.items():
                    scalars[f"rrfp/size_prediction_error/{self.stage_label(stage)}"] = error
            if self.self_driving:
                scalars.update(self_driving_scalars(gathered, self.label))
            step_ms = max(stats.step_time for stats in gathered) * 1e3
            scalars["rrfp/step_time_ms"] = step_ms
            line.append(f"{step_ms:.0f} ms")
            line += [" ".join([self.label(stats), *filter(None, (m.show(stats) for m in METRICS)),
                               *size_error_field(stats)]) for stats in gathered]
        if self.advice is not None:
            scalars.update(self.advice.add(step, gathered))
            line += filter(None, [self.advice.ab_note])
        if line:
            fixed = " (fixed order)" if gathered[0].policy == "fixed" else ""
            logger.info(f"rrfp step {step:2}{fixed}: " + " | ".join(line))
        if self.trace_folder:
            os.makedirs(self.trace_folder, exist_ok=True)
            write_chrome_trace(gathered, os.path.join(self.trace_folder, f"step{step}.json"))
        return scalars

    def _exchange(self, step: int) -> list[StepStats] | None:
        """Post this rank's stats of ``step`` to the job's store; return the pipeline's, by
        pipeline rank, where this rank reads (else None).

        Through the store rather than a collective: a gloo collective's worker thread lets
        go of its tensors only after the collective has returned, and when that happens
        after the last step, once the interpreter is shutting down, the process aborts (the
        release needs the GIL)."""
        mine = f"{step}/{dist.get_rank(self.pp_group)}"
        self._store.set(mine, pickle.dumps(self.schedule.last_step_stats))
        gathered = [pickle.loads(self._store.get(f"{step}/{rank}"))
                    for rank in range(dist.get_world_size(self.pp_group))] if self.reads else None
        # Every reader has read the previous key: this rank got here through a later
        # training step, which each reader joined only after its log of that one.
        if self._posted not in (None, mine):
            self._store.delete_key(self._posted)
        self._posted = mine
        return gathered


def log_step_stats(trainer, schedule: ScheduleRRFP, settings, metrics_rank: int,
                   dump_folder: str, tensorboard_folder: str | None, total_steps: int) -> None:
    """Add the pipeline's RRFP stats to each ``metrics_processor.log`` call of torchtitan's
    ``trainer`` (both versions): TensorBoard scalars where torchtitan writes TensorBoard
    (``metrics_rank``, into ``tensorboard_folder``; None: TensorBoard off), the console
    line where torchtitan's lines print, traces of each run in a folder of their own under
    ``dump_folder``; on ``metrics_rank`` the advisor's verdict, the in-run A/B and, at the
    trainer's close, the run's summary (``torchtitan_ext.common.run_advice``);
    ``total_steps``: the step the run ends at."""
    if not (settings.log_stats or settings.trace_folder or settings.advise):
        return
    parallel_dims = trainer.parallel_dims
    # The rank that logs the loss (and writes TensorBoard) writes its pipeline's traces,
    # each run into a folder of its own.
    trace_folder = None
    if settings.trace_folder and dist.get_rank() == metrics_rank:
        trace_folder = os.path.join(dump_folder, settings.trace_folder,
                                    datetime.now().strftime("%Y%m%d-%H%M%S"))
    batch_mesh = parallel_dims.get_optional_mesh("batch")
    # Only the ranks that show the stats read them: every read goes to the store's server.
    stats_log = StepStatsLog(
        schedule, parallel_dims.get_mesh("pp").get_group(),
        replica=None if batch_mesh is None else batch_mesh.get_local_rank(),
        log_stats=settings.log_stats, trace_folder=trace_folder,
        reads=dist.get_rank() in {metrics_rank} | log_ranks(metrics_rank),
        self_driving=settings.tune_within not in (None, ""))
    if dist.get_rank() == metrics_rank:
        stats_log.advice = RunAdvice(
            schedule, source=trace_folder or "(set rrfp.trace_folder to keep the traces)",
            label=stats_log.label, advise=settings.advise, total_steps=total_steps,
            tensorboard_folder=tensorboard_folder, tune_within=settings.tune_within)
        torch_close = trainer.close

        @functools.wraps(torch_close)
        def close():
            try:
                stats_log.advice.finish()
            finally:
                torch_close()

        trainer.close = close
    torch_log = trainer.metrics_processor.log

    @functools.wraps(torch_log)
    def log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        rrfp_metrics = stats_log.log(step)
        torch_log(step, global_avg_loss, global_max_loss, grad_norm,
                  extra_metrics={**(extra_metrics or {}), **rrfp_metrics})

    trainer.metrics_processor.log = log
