"""What users read off a schedule's runtime: the limits and policy of the next step, the
last step's stats, what earlier steps taught the policies, the self-driving decisions."""

from __future__ import annotations

from rrfp.core.history import History
from rrfp.core.limits import ByteLimits, MemoryLimits
from rrfp.core.stats import StepStats
from rrfp.runtime.pipeline import PipelineRuntime


class RuntimeReadout:
    """What users read off a schedule's runtime (``self._runtime``, a ``PipelineRuntime``):
    the limits and policy of the next step, the last step's stats, what earlier steps
    taught the policies."""

    _runtime: PipelineRuntime

    @property
    def history(self) -> History:
        """What earlier steps showed this rank (device durations per stage and kind,
        arrival times): what the ``lookahead`` and ``critical`` policies decide by."""
        return self._runtime.history

    @property
    def fit_sharing_seconds(self) -> float:
        """Seconds this rank spent so far sharing duration fits with the others (store
        round trips; only in steps given sizes: ``ScheduleRRFP.step(mb_sizes=...)``)."""
        return self._runtime.fit_sharing.seconds

    @property
    def buffer_limits(self) -> MemoryLimits:
        """The memory limits of the next training step (``rrfp.core.limits.MemoryLimits``)."""
        return self._runtime.limits.limits

    @property
    def byte_limits(self) -> ByteLimits | None:
        """Where ``buffer_limit`` is in bytes: the microbatch limits derived from the first
        step's bytes (from the second step on), with the budgets they keep."""
        return self._runtime.limits.byte_limits

    @property
    def policy(self) -> str:
        """The policy of the next training step."""
        return self._runtime.limits.policy

    @property
    def limit_summary(self) -> str:
        """One sentence on what ``buffer_limit`` allows on this rank (as logged)."""
        return self._runtime.limits.summary

    @property
    def launch_depth(self) -> float:
        return self._runtime.launch_depth

    @property
    def tuning_decisions(self) -> list[str]:
        """Self-driving (``Settings.tune_within``): each decision that took effect, one
        line each (what runs from which step, why, predicted and measured speedups);
        empty otherwise."""
        driving = self._runtime.self_driving
        return list(driving.decisions) if driving is not None else []

    @property
    def tuning_waiting(self) -> str | None:
        """Self-driving: why the latest wanted prediction waited for the CPU share
        predictions may take (None: none waited, or not self-driving)."""
        driving = self._runtime.self_driving
        return driving.waiting if driving is not None else None

    @property
    def report_folder(self) -> str | None:
        """Where the job's hang report goes (``ScheduleRRFP``'s ``report_folder``)."""
        return self._runtime.report.folder

    @report_folder.setter
    def report_folder(self, folder: str | None) -> None:
        self._runtime.report.folder = folder

    @property
    def last_step_stats(self) -> StepStats | None:
        """What happened in the last step on this rank (``rrfp.core.stats.StepStats``)."""
        return self._runtime.last_step_stats

    @property
    def activation_bytes_per_microbatch(self) -> dict[int, int] | None:
        """Per local stage, the most bytes one microbatch's forward saved for backward in
        the last metered training step (None before one)."""
        return self._runtime.activation_bytes_per_microbatch
