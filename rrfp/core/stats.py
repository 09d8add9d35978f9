"""What happened in one step on one rank, and the realized timeline as a trace."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields

from rrfp.core.sizes import MicrobatchSize


@dataclass(frozen=True)
class Span:
    """An interval in seconds from the step's start: an action on the device, or the CPU
    waiting with nothing to launch."""

    name: str
    start: float
    end: float
    stage: int | None = None
    kind: str | None = None
    """``"F"``, ``"B"``, ``"I"``, ``"W"``, ``"REDUCE_GRAD"`` (device), or ``"wait"`` (CPU)."""
    microbatch: int | None = None


@dataclass
class StepStats:
    """Per-step, per-rank statistics of a ``ScheduleRRFP.step``."""

    pp_rank: int
    global_rank: int
    hint: str
    policy: str
    device: str
    """The device actions ran on (``CudaDevice``, ``HostDevice``, ``EmulatedDevice``)."""
    launch_depth: float
    """Launched-but-incomplete actions the device could hold (``inf``: no bound)."""
    buffer_limits: dict[int, int] | None
    """Per local stage: microbatches of activations it may hold (None in forward-only
    steps). Held: from a microbatch's F until its last backward piece (B or W)."""
    rank_buffer_limit: int | None
    """Microbatches of activations the rank's stages may hold together."""
    hint_peak_in_flight: dict[int, int]
    """The fixed schedule's own peak of microbatches held, per local stage."""
    hint_rank_peak: int
    """The fixed schedule's peak of microbatches held by the rank's stages together."""
    hint_busiest_rank_peak: int
    """The fixed schedule's busiest rank's peak (the largest ``hint_rank_peak`` of any
    rank): the one that sizes the job's memory. While ``peak_rank_in_flight`` stays at or
    below it on every rank (it does under ``buffer_limit="busiest"``), the job's peak, in
    microbatches held, is the fixed schedule's."""
    peak_in_flight: dict[int, int]
    """Realized peak of microbatches held, per local stage."""
    peak_rank_in_flight: int
    """Realized peak of microbatches held by the rank's stages together."""
    peak_activation_bytes: int | None
    """Most bytes of saved activations alive at once on the rank during the step, measured
    on the tensors themselves (``rrfp.runtime.meter.ActivationMeter``; parameters excluded).
    None: not measured in this step (``meter_activations=False``, or a step between the
    metered ones: the first training step and every ``meter_every``-th)."""
    receive_buffer_bytes: int
    """Most bytes the rank's receive buffers held at once (a ring per incoming channel)."""
    messages_sent: int
    """Tensors sent (a message of several tensors counts each; a shape header counts)."""
    bytes_sent: int
    backpressure_entries: dict[int, int]
    """Times each stage reached its limit with forwards still to run."""
    out_of_hint_order: int
    """Actions dispatched while an action ranked before them in the hint that ranked
    (``ranked_by`` where set) had not run."""
    hint_order: list[str]
    """The rank's actions in ``hint``'s order."""
    realized_order: list[str]
    step_time: float
    """Seconds from the start of the step's schedule loop to its end (sends completed)."""
    device_busy_time: float
    """Seconds the device spent running the step's actions (device timing: CUDA events,
    or the emulated device's clock)."""
    wait_time: float
    """Seconds waiting for a message or a completion with nothing to launch."""
    decision_time: float
    """Seconds choosing actions: the arbiter and the bookkeeping of arrivals and
    completions (the dispatch overhead), on the host thread's clock (wall time: waits for
    the GIL or a CPU included, as they delay the next launch too)."""
    launch_time: float
    """Seconds launching actions (on a synchronous device this includes the compute)."""
    start_unix: float
    """Wall-clock time of the step start, to align traces of several ranks."""
    coordination: str | None = None
    """How the coordination group settled actions ("leader", "agree"; None: no group)."""
    coordination_rounds: int = 0
    """Collectives the coordination made (broadcasts or all-gathers of proposals)."""
    coordination_deferrals: int = 0
    """Proposal rounds that ended without agreement (all deferred and retried)."""
    coordination_time: float = 0.0
    """Seconds spent settling actions, including the waits after a deferral."""
    activation_bytes_per_microbatch: dict[int, int] | None = None
    """Per local stage, the most bytes one microbatch's forward saved for backward, in the
    last metered training step (this one or an earlier one; None before any)."""
    rank_budget_bytes: int | None = None
    """Under a byte ``buffer_limit`` (``"busiest"``, a budget, ``"auto"``), from the second
    step on: the activation bytes this rank may hold; else None."""
    rank_limit_bytes: int | None = None
    """The most activation bytes the rank's microbatch limits let it hold (its worst mix of
    stages' microbatches, at the measured bytes per microbatch): within
    ``rank_budget_bytes`` unless the hint's own peaks already exceed it (then warned)."""
    busiest_rank_peak_bytes: int | None = None
    """The bytes the fixed schedule's busiest rank holds at its peak (the hint's order,
    at the measured bytes per microbatch). Under ``"busiest"`` every rank's
    ``rank_limit_bytes`` is at most this: the job's peak activation bytes are unchanged."""
    step: int = 0
    """Steps the schedule ran before this one: the same count on every rank of the
    pipeline, so the trace can tell which step's send a receive answers."""
    buffer_limit: str = ""
    """The ``buffer_limit`` setting as the user wrote it (``"hint"``, ``"busiest"``, ...);
    self-driving: ``tune_within=`` and the budget (the step's limits: ``buffer_limits``)."""
    num_stages: int = 0
    """Stages of the whole pipeline (the hint's)."""
    n_microbatches: int = 0
    """Microbatches per step."""
    placement: str = ""
    """The hint's stage placement: ``"loop"``, ``"v"`` or ``"custom"``."""
    size_prediction_error: dict[int, float] | None = None
    """Per stage of this rank, how far the durations predicted from the step's microbatch
    sizes (``step(mb_sizes=...)``, before this step's own durations were learnt) fell from
    the measured ones: the median of |predicted - measured| / measured. None: the step had
    no sizes that tell microbatches apart, or no fit yet (the first steps with sizes)."""
    sizes: list[MicrobatchSize | None] | None = None
    """The training step's microbatch sizes as ``step(mb_sizes=...)`` gave them, whether or
    not its policy was told them (None: none given, or a forward-only step): what a replay
    of the step gives the settings it predicts."""
    sizes_used: bool = False
    """Whether the step's policy was told ``sizes`` (a self-driving setting may run
    without them)."""
    ranked_by: str | None = None
    """The interchangeable hint that ranked the step's ready actions in place of ``hint``
    (a self-driving setting's, ``Settings.tune_hints``); None: ``hint`` itself. The
    step's limits and the ``hint_*`` peaks are ``hint``'s either way."""
    spans: list[Span] = field(default_factory=list)
    arrivals: list[tuple[int, int, int, float]] = field(default_factory=list)
    """(source stage, destination stage, microbatch, seconds after start) of each
    message received."""
    sends: list[tuple[int, int, int, float]] = field(default_factory=list)
    """The same for each message sent (when the send was issued)."""

    @property
    def dispatched(self) -> int:
        return len(self.realized_order)

    @property
    def idle_time(self) -> float:
        """Seconds the device had nothing to run during the step."""
        return max(0.0, self.step_time - self.device_busy_time)

    @property
    def idle_fraction(self) -> float:
        return self.idle_time / self.step_time if self.step_time > 0 else 0.0

    @property
    def overhead_per_action(self) -> float:
        """Mean dispatch overhead per action, in seconds."""
        return self.decision_time / self.dispatched if self.dispatched else 0.0

    def summary(self) -> str:
        activations = ("not measured" if self.peak_activation_bytes is None
                       else f"{self.peak_activation_bytes} B")
        if self.rank_budget_bytes is not None:
            activations += (f" (limits allow {self.rank_limit_bytes} B, budget "
                            f"{self.rank_budget_bytes} B; fixed schedule's busiest rank "
                            f"{self.busiest_rank_peak_bytes} B)")
        return (
            f"pp_rank {self.pp_rank}: hint {self.hint} (policy {self.policy}), limits "
            f"{self.buffer_limits}, step {self.step_time * 1e3:.1f} ms, idle "
            f"{self.idle_fraction:.1%}, out-of-hint-order {self.out_of_hint_order}/"
            f"{self.dispatched}, peak held {self.peak_in_flight} per stage, "
            f"{self.peak_rank_in_flight} on the rank (hint {self.hint_peak_in_flight}, "
            f"{self.hint_rank_peak}; busiest rank {self.hint_busiest_rank_peak}), peak "
            f"activations {activations}, "
            f"receive buffers {self.receive_buffer_bytes} B, backpressure entries "
            f"{self.backpressure_entries}, "
            f"dispatch overhead {self.overhead_per_action * 1e6:.0f} us/action, launch depth "
            f"{self.launch_depth} on {self.device}"
        )

    def metadata(self) -> dict:
        """Every field but the timeline (spans, messages, the realized order), as JSON
        values: what ``python -m rrfp.advise`` reads off a trace besides the timeline.
        Maps keyed by stage are keyed by its number as a string; an unbounded launch
        depth is None; each size is its fields (``MicrobatchSize``) or None."""
        timeline = {"spans", "arrivals", "sends", "realized_order"}
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in timeline}
        if math.isinf(self.launch_depth):
            values["launch_depth"] = None
        if self.sizes is not None:
            values["sizes"] = [None if size is None else asdict(size) for size in self.sizes]
        return values

    def chrome_trace_events(self) -> list[dict]:
        """Chrome/Perfetto trace events: one process per rank; the device's actions on one
        track, the CPU's waits on another, messages on a third: each send and each receive
        a short fixed-length slice at its time, a flow arrow from the send to its receive (on the peer's
        track: merge the ranks' traces to see both ends); and the step's other fields as
        the arguments of a metadata event named ``STEP_METADATA``."""
        pid = self.global_rank
        events: list[dict] = [
            {"ph": "M", "name": STEP_METADATA, "pid": pid, "args": self.metadata()},
            {"ph": "M", "name": "process_name", "pid": pid,
             "args": {"name": f"rank {self.global_rank} (pp {self.pp_rank})"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "device"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1,
             "args": {"name": "cpu (waiting)"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": MESSAGE_TRACK,
             "args": {"name": "messages"}},
        ]
        base_us = self.start_unix * 1e6
        for span in self.spans:
            events.append({
                "ph": "X", "pid": pid, "tid": 1 if span.kind == "wait" else 0, "name": span.name,
                "cat": span.kind or "", "ts": base_us + span.start * 1e6,
                "dur": (span.end - span.start) * 1e6,
                "args": {"stage": span.stage, "microbatch": span.microbatch},
            })
        for cat, messages in (("send", self.sends), ("recv", self.arrivals)):
            for src, dst, mb, offset in messages:
                ts = base_us + offset * 1e6
                events.append({
                    "ph": "X", "pid": pid, "tid": MESSAGE_TRACK, "cat": cat,
                    "name": f"{cat} {src}->{dst} mb {mb}", "ts": ts, "dur": 1.0,
                    "args": {"src": src, "dst": dst, "microbatch": mb},
                })
                # A flow event binds to the slice enclosing it: inside the message's own
                # slice, not at its edge, where another slice may begin or end. Both ends
                # compute the id from the message and the step alone (a microbatch
                # crosses an edge once per step; Perfetto keeps a flow id once used).
                flow = {"ph": "s"} if cat == "send" else {"ph": "f", "bp": "e"}
                events.append({**flow, "pid": pid, "tid": MESSAGE_TRACK, "cat": "message",
                               "name": f"{src}->{dst} mb {mb}", "ts": ts + 0.5,
                               "id": message_flow_id(self.step, src, dst, mb)})
        return events

    def write_chrome_trace(self, path: str | os.PathLike) -> None:
        """Write this rank's timeline; open it in https://ui.perfetto.dev or chrome://tracing."""
        write_chrome_trace([self], path)


MESSAGE_TRACK = 2
"""The trace's thread id for a rank's messages."""
STEP_METADATA = "rrfp_step"
"""The name of the metadata event that carries a rank's ``StepStats.metadata()``."""


def message_flow_id(step: int, src: int, dst: int, microbatch: int) -> int:
    """The trace's flow id of the message of ``microbatch`` from stage ``src`` to ``dst``
    in ``step`` (a stage sends only to its neighbours: ``dst - src + 1`` is 0 or 2)."""
    return ((step * (1 << 24) + microbatch) * (1 << 20) + src) * 4 + (dst - src + 1)


def write_chrome_trace(stats: Iterable[StepStats], path: str | os.PathLike) -> None:
    """Write the timelines of several ranks (or steps) into one trace file."""
    events = [e for s in stats for e in s.chrome_trace_events()]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def merge_chrome_traces(paths: Iterable[str | os.PathLike], out: str | os.PathLike) -> None:
    """Merge per-rank trace files into one, so all ranks show on one timeline."""
    events: list[dict] = []
    for path in paths:
        with open(path) as f:
            events.extend(json.load(f)["traceEvents"])
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
