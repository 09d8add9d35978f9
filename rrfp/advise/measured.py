"""What a run measured, read back from its traces: the steps the simulator replays.

A trace is one step of every rank of a pipeline (``rrfp.write_chrome_trace`` of the ranks'
``last_step_stats``; torchtitan writes ``<trace_folder>/<run start>/step<N>.json``): the
compute spans and messages give the step's timings (``rrfp.sim.replay.timing_from_trace``),
each rank's ``rrfp_step`` metadata event the rest (hint, placement, microbatches, limits,
policy, bytes per microbatch per stage). A run is the traces of one job: one hint,
placement, microbatch count and ``buffer_limit``; steps may differ in policy (the in-run
A/B runs every k-th step in the fixed order). Every refusal is an ``AdviceError`` whose
message says what is missing.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rrfp.core.hints import build_hint, Hint, HINT_NAMES
from rrfp.core.limits import MemoryLimits
from rrfp.core.stats import Span, STEP_METADATA
from rrfp.core.text import counted
from rrfp.sim.replay import timing_from_trace
from rrfp.sim.workloads import Timing

TRACE_FILE = re.compile(r"step(\d+)\.json")
"""How torchtitan_ext names a step's trace."""
SHAPE = ("hint", "placement", "num_stages", "n_microbatches", "buffer_limit")
"""What every step of one run shares."""
READ = (*SHAPE, "pp_rank", "step", "policy", "device", "launch_depth", "step_time",
        "start_unix", "decision_time", "hint_order", "hint_peak_in_flight", "buffer_limits",
        "rank_buffer_limit", "activation_bytes_per_microbatch")
"""The metadata fields the advisor reads."""


class AdviceError(ValueError):
    """A run the advisor cannot read or predict from; the message says what is missing."""


@dataclass(frozen=True, eq=False)
class MeasuredStep:
    """One step of every rank of the pipeline, as its trace recorded it (equal only to
    itself)."""

    source: str
    """Where it was read from (a file name)."""
    timing: Timing
    """Per-action durations and per-message latencies (seconds)."""
    ranks: Mapping[int, Mapping]
    """Per pipeline rank: its ``StepStats.metadata()``."""
    spans: Mapping[int, list[Span]]
    """Per pipeline rank: its actions, in seconds from the earliest rank's start."""

    @property
    def number(self) -> int:
        """Steps the schedule ran before this one."""
        return self.ranks[0]["step"]

    @property
    def policy(self) -> str:
        return self.ranks[0]["policy"]

    @property
    def ranked_by(self) -> str | None:
        """The interchangeable hint that ranked the step (None: the run's own hint)."""
        return self.ranks[0].get("ranked_by")

    @property
    def fixed_order(self) -> bool:
        """Whether the step ran the hint's fixed order (the in-run A/B's baseline)."""
        return self.policy == "fixed"

    @property
    def step_time(self) -> float:
        """Seconds of the pipeline's step: its slowest rank's."""
        return max(r["step_time"] for r in self.ranks.values())

    @property
    def sizes_used(self) -> bool:
        """Whether the step's policy was told its microbatch sizes (``timing.sizes``)."""
        return bool(self.ranks[0].get("sizes_used")) and self.timing.sizes is not None

    @property
    def training(self) -> bool:
        return all(r["buffer_limits"] is not None for r in self.ranks.values())


@dataclass(frozen=True)
class MeasuredRun:
    """The steps of one run the advisor predicts from."""

    source: str
    hint: Hint
    buffer_limit: str
    policy: str
    """The policy of the run's own (not fixed-order) steps."""
    device: str
    launch_depth: float
    """Launched-but-incomplete actions its device held (1 on a synchronous device)."""
    fixed_launch_depth: float
    """The same for the fixed schedule: without bound on an asynchronous device, as torch's
    schedules launch; 1 on a synchronous one, whose CPU runs each action."""
    dispatch_cost: float
    """Median seconds (host clock) the runtime spent deciding per action (the simulator's launch
    cost)."""
    limits: MemoryLimits
    """The microbatch limits its last step ran at (a byte setting's, as settled)."""
    bytes_per_microbatch: Mapping[int, int] | None
    """Per stage, the bytes one microbatch's forward saved (None: not measured)."""
    steps: tuple[MeasuredStep, ...]
    """Its training steps after the first (warm-up), in order."""
    left_out: int
    """Steps read but left out: the first (warm-up) and forward-only ones."""
    ranked_by: Hint | None = None
    """The interchangeable hint its own steps' last ranked by (a self-driving setting's);
    None: ``hint`` itself."""

    @property
    def actions(self) -> int:
        """The actions its steps ran, on every rank."""
        return sum(len(spans) for step in self.steps for spans in step.spans.values())

    @property
    def own_steps(self) -> list[MeasuredStep]:
        """The steps that ran the run's own setting (not the in-run A/B's fixed order);
        all of them where every step ran the fixed order."""
        return [s for s in self.steps if not s.fixed_order] or list(self.steps)


def trace_files(path: str) -> tuple[str, list[str], str]:
    """The folder of the run to read, its step traces in step order, and a note on which
    run was chosen where ``path`` holds several (the newest). ``path``: a trace file, the
    folder of one run's traces, or a folder above them (a torchtitan dump folder)."""
    if not os.path.exists(path):
        raise AdviceError(f"{path}: no such file or folder: give the run's folder (the job's "
                          "dump folder, or the folder its traces went to)")
    if os.path.isfile(path):
        return os.path.dirname(path) or ".", [path], ""
    runs: dict[str, list[str]] = {}
    for folder, _, names in os.walk(path):
        found = [n for n in names if TRACE_FILE.fullmatch(n)]
        if found:
            runs[folder] = [os.path.join(folder, n) for n in found]
    if not runs:
        raise AdviceError(
            f"{path} holds no step traces (step<N>.json): run the job with traces on "
            "(torchtitan: rrfp.trace_folder = \"traces\"; ScheduleRRFP: "
            "rrfp.write_chrome_trace of every rank's last_step_stats) and pass that folder")
    newest = max(runs, key=lambda f: max(os.path.getmtime(p) for p in runs[f]))
    note = (f"{path} holds the traces of {len(runs)} runs; reading the newest, {newest}"
            if len(runs) > 1 else "")
    files = sorted(runs[newest], key=lambda p: int(TRACE_FILE.fullmatch(os.path.basename(p))[1]))
    return newest, files, note


def read_trace(path: str) -> dict:
    try:
        with open(path) as f:
            trace = json.load(f)
    except json.JSONDecodeError as e:
        raise AdviceError(f"{path}: not a whole JSON trace ({e.msg} at character {e.pos} of "
                          f"{os.path.getsize(path)}): the file is cut short or is not a "
                          "trace; rerun the step, or move the file out of the folder") from None
    except UnicodeDecodeError:
        raise AdviceError(f"{path}: not a JSON trace (binary content)") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise AdviceError(f"{path}: not a Chrome trace (no traceEvents list)")
    return trace


def measured_step(trace: dict, source: str) -> MeasuredStep:
    """One step from a trace of every rank of the pipeline."""
    try:
        return _measured_step(trace, source)
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise AdviceError(f"{source}: its events are not those rrfp writes ({type(e).__name__}: "
                          f"{e}): the file was changed, or another program wrote it") from None


def _measured_step(trace: dict, source: str) -> MeasuredStep:
    metadata = {e["pid"]: e["args"] for e in trace["traceEvents"]
                if e.get("ph") == "M" and e.get("name") == STEP_METADATA}
    if not metadata:
        raise AdviceError(
            f"{source}: no {STEP_METADATA!r} metadata in the trace: it is not a ScheduleRRFP "
            "step trace, or an rrfp older than the advisor wrote it; rerun the job")
    for args in metadata.values():
        missing = [key for key in READ if key not in args]
        if missing:
            raise AdviceError(f"{source}: its step metadata lacks {missing}: an rrfp older "
                              "than the advisor wrote it; rerun the job")
    ranks = {args["pp_rank"]: args for args in metadata.values()}
    first = next(iter(ranks.values()))
    expected = set(range(first["num_stages"] // _stages_per_rank(first)))
    if set(ranks) != expected:
        raise AdviceError(
            f"{source}: the trace holds pipeline ranks {sorted(ranks)} of {sorted(expected)}: "
            "the advisor needs every rank's step (merge per-rank files with "
            "rrfp.merge_chrome_traces)")
    try:
        timing = timing_from_trace(trace)
    except ValueError as e:
        raise AdviceError(f"{source}: {e}") from None
    if (timing.num_stages, timing.n_microbatches) != (first["num_stages"],
                                                         first["n_microbatches"]):
        raise AdviceError(
            f"{source}: its spans cover {timing.num_stages} stages x {timing.n_microbatches} "
            f"microbatches, its metadata says {first['num_stages']} x "
            f"{first['n_microbatches']}: the trace is incomplete")
    return MeasuredStep(source, timing, dict(sorted(ranks.items())), _spans(trace, metadata))


def _stages_per_rank(metadata: Mapping) -> int:
    return len(metadata["hint_peak_in_flight"])


def _spans(trace: dict, metadata: Mapping[int, Mapping]) -> dict[int, list[Span]]:
    """Per pipeline rank, its compute spans in seconds from the earliest rank's start."""
    origin = min(args["start_unix"] for args in metadata.values())
    spans: dict[int, list[Span]] = {args["pp_rank"]: [] for args in metadata.values()}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("F", "B", "I", "W") and e["pid"] in metadata:
            start = e["ts"] / 1e6 - origin
            spans[metadata[e["pid"]]["pp_rank"]].append(Span(
                e["name"], start, start + e["dur"] / 1e6, e["args"]["stage"], e["cat"],
                e["args"]["microbatch"]))
    return spans


def read_run(path: str) -> tuple[MeasuredRun, str]:
    """The run at ``path`` (see ``trace_files``), and the note on which run it is."""
    folder, files, note = trace_files(path)
    return run_of([measured_step(read_trace(f), f) for f in files], folder), note


def run_of(steps: Sequence[MeasuredStep], source: str) -> MeasuredRun:
    """A run from its measured steps (any order): checked to be one job's."""
    if not steps:
        raise AdviceError(f"{source}: no steps to read")
    steps = sorted(steps, key=lambda s: s.number)
    first = steps[0].ranks[0]
    for step in steps:
        this = step.ranks[0]
        differs = [k for k in SHAPE if this[k] != first[k]]
        if differs:
            raise AdviceError(
                f"{step.source} is a step of {_shape(this)}, {steps[0].source} of "
                f"{_shape(first)}: a run's folder holds the traces of one job; pass the "
                "folder of one run")
    used = tuple(s for s in steps if s.number > 0 and s.training)
    if not used:
        raise AdviceError(
            f"{source}: its {counted(len(steps), 'step')} are the first (warm-up) or forward-only "
            "ones; the advisor needs training steps after the first: run more steps")
    own = [s for s in used if not s.fixed_order] or list(used)
    per_action = [r["decision_time"] / len(r["hint_order"]) for s in used
                  for r in s.ranks.values() if r["hint_order"]]
    depth, synchronous = first["launch_depth"], first["device"] == "HostDevice"
    return MeasuredRun(
        source=source, hint=_hint_of(steps[0]), buffer_limit=first["buffer_limit"],
        policy=own[-1].policy, device=first["device"],
        launch_depth=1 if synchronous else float("inf") if depth is None else depth,
        fixed_launch_depth=1 if synchronous else float("inf"),
        dispatch_cost=statistics.median(per_action) if per_action else 0.0,
        limits=_limits_of(used[-1]), bytes_per_microbatch=_bytes_per_microbatch(steps),
        steps=used,
        left_out=len(steps) - len(used), ranked_by=_ranked_by(own[-1]))


def _shape(metadata: Mapping) -> str:
    return (f"hint {metadata['hint']} ({metadata['placement']} placement, "
            f"{metadata['num_stages']} stages) with {metadata['n_microbatches']} microbatches "
            f"at buffer_limit={metadata['buffer_limit']!r}")


def _hint_of(step: MeasuredStep) -> Hint:
    """The run's hint, built again: by its name, or from every rank's order (a CSV or a
    dict hint)."""
    meta = step.ranks[0]
    shape = dict(num_ranks=len(step.ranks), num_stages=meta["num_stages"],
                 n_microbatches=meta["n_microbatches"])
    named = meta["hint"].lower() in {n.lower() for n in HINT_NAMES}
    source = meta["hint"] if named else {r: m["hint_order"] for r, m in step.ranks.items()}
    try:
        return build_hint(source, **shape, layout=meta["placement"])
    except ValueError as e:
        raise AdviceError(f"{step.source}: its hint {meta['hint']!r} cannot be rebuilt: {e}") from None


def _ranked_by(step: MeasuredStep) -> Hint | None:
    """The interchangeable hint that ranked ``step``, built again by its name."""
    if step.ranked_by is None:
        return None
    meta = step.ranks[0]
    return build_hint(step.ranked_by, num_ranks=len(step.ranks),
                      num_stages=meta["num_stages"], n_microbatches=meta["n_microbatches"],
                      layout=meta["placement"])


def _limits_of(step: MeasuredStep) -> MemoryLimits:
    per_stage: dict[int, int] = {}
    for meta in step.ranks.values():
        per_stage.update({int(s): n for s, n in meta["buffer_limits"].items()})
    return MemoryLimits(dict(sorted(per_stage.items())),
                        {r: meta["rank_buffer_limit"] for r, meta in step.ranks.items()})


def _bytes_per_microbatch(steps: Sequence[MeasuredStep]) -> dict[int, int] | None:
    """Per stage, from the last step that carries every stage's (they stay set between
    metered steps); None where the activations were never metered."""
    for step in reversed(steps):
        merged: dict[int, int] = {}
        for meta in step.ranks.values():
            merged.update({int(s): b for s, b in (meta["activation_bytes_per_microbatch"]
                                                  or {}).items()})
        if len(merged) == meta["num_stages"] and any(merged.values()):
            return dict(sorted(merged.items()))
    return None


def run_from_trace_events(steps: Sequence[Sequence[dict]], source: str) -> MeasuredRun:
    """A run from the trace events of each step (all ranks' ``chrome_trace_events``), as a
    job that keeps its steps' stats in memory has them."""
    return run_of([measured_step({"traceEvents": list(events)}, f"{source} step {i}")
                   for i, events in enumerate(steps)], source)
