"""RRFP's settings: the ``[rrfp]`` section of train.toml on torchtitan 0.2.2 (``[job]
custom_config_module = "torchtitan_ext.config"``), the ``rrfp`` field of
``RRFPTrainer.Config`` on torchtitan 0.3 (``--rrfp.<field>``): one dataclass for both,
``RRFPConfig``, written as torchtitan 0.3 writes its own (``TrainingConfig``,
``ParallelismConfig``): keyword-only, slotted, a docstring per field, which tyro shows
as the option's help."""

# No ``from __future__ import annotations``: torchtitan 0.2.2 builds the ``[rrfp]`` section
# from the TOML by the fields' types as classes (``dataclasses.is_dataclass(field.type)``).
from dataclasses import dataclass, field

from rrfp.core.settings import DEFAULT_LAUNCH_DEPTH, DEFAULT_METER_EVERY


@dataclass(kw_only=True, slots=True)
class RRFPConfig:
    """Readiness-first pipeline schedule settings (used by ``RRFP`` / ``RRFP-<hint>`` schedules)."""

    buffer_limit: int | str = "hint"
    """Activations held, per stage and per rank: ``"hint"``, ``"hint+k"``, ``"Nx hint"`` or
    an integer (``4`` or ``"4"`` in TOML, ``--rrfp.buffer_limit 4`` on the command line) in
    microbatches; ``"busiest"``, a per-rank budget (``"12GiB"``) or ``"auto"`` (CUDA) in
    bytes, from the first step's measured bytes per microbatch. Parsed as ScheduleRRFP
    parses it: ``rrfp.core.settings.BUFFER_LIMIT_HELP``. The default stays ``"hint"``, with
    activation checkpointing too: docs/guide/choosing.md gives the measurements and why."""

    policy: str = ""
    """Arbitration policy, case-insensitive: ``hint``, ``drain``, ``lookahead``,
    ``critical``, ``arrival``, ``BF``, ``BFW``, ``fixed``; empty = ScheduleRRFP's
    default (the rule for BF/BFW; else ``lookahead`` at the hint's memory or where some rank
    has less than 2 microbatches of slack; with slack on every rank ``critical`` for one
    stage per rank, ``drain`` for ZBVZeroBubble, ``hint`` for InterleavedZeroBubble,
    ``lookahead`` for other hints with several stages per rank)."""

    coordination: str = "leader"
    """With tensor or expert parallelism, how the coordination group (its TP and EP ranks)
    settles on each action: ``leader`` (its first rank decides and broadcasts) or
    ``agree`` (all-gather proposals, defer on disagreement). ``leader`` was faster in
    benchmarks/results/coordination.md."""

    launch_depth: int | str = DEFAULT_LAUNCH_DEPTH
    """Launched actions the device may hold before the rank decides again (``0`` or
    ``"none"``: no bound, as ``None`` in Python).
    The rank picks what runs next when its GPU is free, so choices see the latest
    arrivals; 2 hides the CPU's launch cost behind the running action
    (benchmarks/results/launch_depth.md)."""

    variable_shapes: bool = False
    """Cut each batch into microbatches as long as their own content (rounded up to 16)
    instead of one padded length, and send activations with a shape header (see
    ``torchtitan_ext.common.data``; for samples that are not packed: the documents and multimodal
    jobs, ``rrfp_llama3_documents`` / ``rrfp_multimodal`` on torchtitan 0.2.2,
    ``DocumentDataLoader`` on 0.3)."""

    meter_activations: bool = True
    """Measure the bytes of the activations saved for backward (``peak_activation_bytes`` in
    the stats) in the first training step and every ``meter_every``-th: the meter costs CPU
    time per saved tensor (docs/guide/memory.md), so it is sampled. A ``buffer_limit`` in bytes
    (``'busiest'``, ``'12GiB'``, ``'auto'``) needs it. The memory limit holds either way."""

    meter_every: int = DEFAULT_METER_EVERY
    """Meter every this-many-th step (1: every step; the steps between log no activation
    bytes)."""

    stall_timeout: float = 300.0
    """Seconds without any ready action before the step raises, naming what it waits for."""

    log_stats: bool = True
    """Log per pipeline rank the idle fraction, out-of-hint dispatches, backpressure entries,
    peak forwards in flight and dispatch overhead at each metrics step (console, and
    TensorBoard ``rrfp/...`` when enabled)."""

    trace_folder: str = ""
    """If set (relative to ``job.dump_folder``), write the realized timeline of the pipeline
    that logs the loss as a Chrome/Perfetto trace at each metrics step, in a folder of its
    own per run named by its start time: ``<folder>/<YYYYmmdd-HHMMSS>/step<N>.json``."""

    advise: bool = True
    """On the rank that logs the loss: the advisor's verdict (the best setting within a
    memory margin, predicted from the run's own measured steps) after the first steps and
    at the end, and an end-of-run summary; computed in a child process at the lowest CPU
    priority (``python -m rrfp.advise``; docs/guide/advisor.md)."""

    fixed_every: int = 0
    """The in-run A/B: every this-many-th training step (2 or more) runs the hint's fixed
    order on the same stages (bitwise the same results), and the measured ratio of step
    times, fixed over RRFP, is logged beside the advisor's prediction; 0: off."""

    tune_within: int | str = ""
    """Self-driving: a memory budget per rank within which RRFP chooses ``buffer_limit``
    and the policy itself, from the run's own measured steps, and keeps checking its choice
    with an in-run A/B of its own: ``"hint+k"``, ``"busiest"``, a byte budget such as
    ``"12GiB"``, or an integer n of microbatches (``--rrfp.tune_within hint+2``); empty:
    off, the setting ``buffer_limit`` and ``policy`` give runs. With it, ``buffer_limit``,
    ``policy`` and ``fixed_every`` stay at their defaults (``"hint"``, empty, ``0``: a job
    whose config sets ``fixed_every`` takes ``--rrfp.fixed_every 0``). Each decision is
    logged as ``rrfp self-driving: ...`` and listed in the end-of-run summary
    (docs/guide/self-driving.md)."""

    tune_hints: bool = False
    """With ``tune_within``: the self-driving candidates also rank ready actions by each
    named hint interchangeable with the schedule's (the same stages on the same ranks and
    the same order within each stage's streams: the same gradients to the bit), at the
    limits the budget gives on the schedule's hint (``--rrfp.tune_hints``; for 1F1B:
    GPipe, Interleaved1F1B and BF; docs/guide/self-driving.md)."""


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """What torchtitan 0.2.2 adds to its own ``JobConfig`` (it imports the class of this
    name from ``job.custom_config_module``): the ``[rrfp]`` section."""

    rrfp: RRFPConfig = field(default_factory=RRFPConfig)
    """Readiness-first pipeline settings (``[rrfp]`` in the TOML, ``--rrfp.<field>``)."""
