"""What a user chooses of RRFP (``Settings``) and how each setting is spelled: one parser
per setting.

``ScheduleRRFP(settings=...)``, the torchtitan ``[rrfp]`` section and the simulator's
command line all parse through these functions, so a value means the same wherever it is
written (TOML and the command line hand over strings where Python code passes ints or
None). The help texts are shared for the same reason. ``rrfp.core.checks.check_settings``
checks a whole ``Settings`` against a hint, in one place.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

POLICIES = ("hint", "drain", "fixed", "BF", "BFW", "lookahead", "arrival", "critical")
"""The arbitration policies ``rrfp.core.policy`` implements."""

COORDINATIONS = ("leader", "agree")
"""How a coordination group settles on each action (``rrfp.comm.coordination``)."""
DEFAULT_LAUNCH_DEPTH = 2
"""Launched-but-incomplete actions a device may hold by default: one queued behind the
running one hides the CPU's launch cost; see ``benchmarks/results/launch_depth.md``."""
DEFAULT_METER_EVERY = 100
"""``ScheduleRRFP`` meters its first training step and every this-many-th step: the meter
costs CPU time per saved tensor (``benchmarks/results/memory.md``), which a step on real
compute pays when its CPU launches the work (docs/guide/memory.md has the figures)."""
DEFAULT_STALL_TIMEOUT_S = 300.0

_REGISTERED: list[str] = []
"""Names of the policies added with ``rrfp.core.policy.register_policy``."""


def policy_names() -> tuple[str, ...]:
    """Every policy a user may name: the built-in ones and the registered ones."""
    return (*POLICIES, *_REGISTERED)


def add_policy_name(name: str) -> None:
    """Accept ``name`` as a policy (``rrfp.core.policy.register_policy`` calls it)."""
    if not name.strip() or any(known.lower() == name.strip().lower()
                               for known in policy_names()):
        raise ValueError(f"policy name {name!r} is empty or already taken: "
                         f"{list(policy_names())}")
    _REGISTERED.append(name.strip())


@dataclass(kw_only=True)
class Settings:
    """What a user chooses of RRFP, every rank of the job the same
    (``ScheduleRRFP(settings=Settings(...))``; torchtitan's ``[rrfp]`` section adds its own
    fields to these). Checked and parsed in one place: ``rrfp.core.checks.check_settings``.
    Full reference: docs/reference/api.md."""

    buffer_limit: int | str = "hint"
    """Activations held, from a microbatch's forward until its last backward piece (B, or
    W under split backward), per stage and per rank: ``"hint"`` (the fixed schedule's own
    peaks: no more activation memory than the hint), ``"hint+k"``, ``"Nx hint"``, an int n
    (microbatches); or in bytes: ``"busiest"`` (every rank may hold what the fixed
    schedule's busiest rank holds, so the job's peak is unchanged), a per-rank budget such
    as ``"12GiB"``, or ``"auto"`` (CUDA: the free device memory less a margin). A byte
    setting runs the first training step at ``"hint"`` and then the largest microbatch
    limits within its bytes."""

    policy: str | None = None
    """How to pick among ready actions (``rrfp.core.policy``, case-insensitive); None or
    empty: ``rrfp.core.policy.default_policy`` for the hint and the limits."""

    coordination: str = "leader"
    """How a coordination group (``ScheduleRRFP``'s ``coordination_group``) settles on
    each action: ``"leader"`` (its first rank decides) or ``"agree"`` (all-gather
    proposals, defer on disagreement)."""

    launch_depth: int | str | None = DEFAULT_LAUNCH_DEPTH
    """Launched actions the device may hold before the rank decides again (None, 0 or
    ``"none"``: no bound). The rank decides when its device is free, on the latest
    arrivals; a depth above 1 hides the CPU's launch cost."""

    variable_shapes: bool = False
    """Microbatches may differ in shape (e.g. in sequence length): each activation is
    preceded by a small shape header. Feed them pre-split: ``step(arg_mbs=...,
    target_mbs=...)``."""

    meter_activations: bool = True
    """Measure the bytes of the activations saved for backward
    (``StepStats.peak_activation_bytes``) in the first training step and every
    ``meter_every``-th. A limit in bytes needs it."""

    meter_every: int = DEFAULT_METER_EVERY
    """Meter every this-many-th step (and the first training step); 1: every step."""

    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S
    """Seconds without any ready action before the step raises ``PipelineStallError``
    naming what each stream waits for."""

    fixed_every: int = 0
    """The in-run A/B: every k-th training step (k >= 2; 0: never) runs the hint's fixed
    order, launched without bound as torch's (docs/guide/advisor.md)."""

    tune_within: int | str | None = None
    """Self-driving: a memory budget within which RRFP chooses ``buffer_limit`` and the
    policy itself, from the job's own measured steps, and keeps verifying its choice with
    the in-run A/B (``"hint+k"``, ``"busiest"``, a byte budget per rank such as
    ``"12GiB"``, or an int n of microbatches; docs/guide/self-driving.md). Leave
    ``buffer_limit``, ``policy`` and ``fixed_every`` at their defaults with it. None (or
    ``""``): the setting those fields give."""

    tune_hints: bool = False
    """Self-driving (with ``tune_within``): the candidates also rank ready actions by each
    named hint interchangeable with ``hint`` (``rrfp.core.hints.interchangeable_hints``:
    the same stages on the same ranks and the same order within each stage's streams, so
    the same gradients to the bit), at the limits the budget gives on ``hint``. For a
    1F1B hint: GPipe, Interleaved1F1B and the BF rule; for ZBVZeroBubble: the BFW rule."""

    report_folder: str | None = None
    """Where the job's hang report goes when a step stalls (None: the current working
    directory); docs/guide/failures.md."""


BUFFER_LIMIT_HELP = (
    "activations held (from a microbatch's forward until its last backward piece), per "
    "stage and per rank (a rank's stages together): 'hint' (the fixed schedule's own peaks, "
    "per stage and per rank), 'hint+k' (k more microbatches), 'Nx hint' (N times them, e.g. "
    "'2x hint'), 'busiest' (every rank may hold the bytes the fixed schedule's busiest rank "
    "holds: that rank's peak, which sizes the job's memory, is unchanged), a byte budget per "
    "rank such as '512MiB' or '12GiB' (units B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB), "
    "'auto' (on CUDA, the device's free memory after the first step less a margin), or an "
    "integer n (n microbatches on each stage and each rank). 'busiest', a budget and 'auto' "
    "are turned into microbatch limits from the bytes the first step measured")
LAUNCH_DEPTH_HELP = (
    "launched-but-incomplete actions the device may hold before the rank decides again: an "
    "integer >= 1, or 0 or 'none' for no bound")


def policy_help(names: Sequence[str]) -> str:
    return ("how to pick among ready actions, case-insensitive: " + ", ".join(names)
            + "; none given: ScheduleRRFP's default (the rule of a BF/BFW hint; else "
            "lookahead at the hint's memory or where some rank has no slack; with slack on "
            "every rank critical for one stage per rank, lookahead for several)")


BYTE_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
              "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
"""The units a byte budget may be written in (case-insensitive): binary and decimal."""


@dataclass(frozen=True)
class BufferLimit:
    """A parsed ``buffer_limit``: ``value`` microbatches, or (``value`` None) ``factor``
    times the hint's own peak plus ``extra``, or (``busiest``) the bytes of the hint's
    busiest rank's peak, or a per-rank byte budget (``budget_bytes``; ``auto``: the
    device's free memory). The byte settings become microbatch limits once the first step
    has measured each stage's bytes per microbatch (``rrfp.core.limits.limits_within_bytes``);
    ``of`` gives the limit before that: the hint's own peak (the first step runs at the
    hint's memory), or for ``busiest`` the busiest rank's peak in microbatches (what it
    means where every stage's microbatch saves the same bytes, as in the simulator)."""

    value: int | None
    factor: int = 1
    extra: int = 0
    busiest: bool = False
    budget_bytes: int | None = None
    auto: bool = False
    spec: str | int = field(default="", compare=False)
    """How the user wrote it (for messages; two spellings of one limit are equal)."""

    @property
    def in_bytes(self) -> bool:
        """Counted in bytes: the microbatch limits come from the first step's bytes."""
        return self.busiest or self.auto or self.budget_bytes is not None

    def of(self, peak: int, busiest_peak: int) -> int:
        """The limit where the hint's own peak is ``peak`` and its busiest rank's (the most
        any rank's stages hold together at once) is ``busiest_peak``."""
        if self.busiest:
            return busiest_peak
        return self.value if self.value is not None else self.factor * peak + self.extra


_UNDERSTOOD = ("use 'hint' (the fixed schedule's own peaks per stage and per rank), 'hint+k' "
               "with k >= 0, 'Nx hint' with N >= 1, 'busiest' (the bytes the fixed "
               "schedule's busiest rank holds, on every rank), a byte budget per rank such as "
               "'512MiB' or '12GiB', 'auto' (CUDA: the free device memory), or an int >= 1 "
               "(microbatches)")


def parse_buffer_limit(spec: object) -> BufferLimit:
    """``"hint"``, ``"hint+k"``, ``"Nx hint"``, ``"busiest"``, a byte budget (a number and
    a unit of ``BYTE_UNITS``, e.g. ``"12GiB"``, ``"1.5 GB"``), ``"auto"``, an int n >= 1, or
    n written as a string (case and spaces do not matter); a ``BufferLimit`` as it is.
    ``ValueError`` saying what to write otherwise."""
    if isinstance(spec, BufferLimit):
        return spec
    return replace(_parsed_buffer_limit(spec), spec=spec)  # type: ignore[arg-type]


def _parsed_buffer_limit(spec: object) -> BufferLimit:
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise ValueError(f"buffer_limit must be a str or an int: {_UNDERSTOOD}; got {spec!r}")
    text = spec if isinstance(spec, int) else spec.replace(" ", "").lower()
    if isinstance(text, int) or text.isdigit():
        value = int(text)
        if value < 1:
            raise ValueError(
                f"buffer_limit={spec!r} is below 1: at least one microbatch per stage must be "
                "allowed in flight; use an int >= 1, 'hint', 'hint+k' or 'Nx hint'")
        return BufferLimit(value)
    if text == "hint":
        return BufferLimit(None)
    if text == "busiest":
        return BufferLimit(None, busiest=True)
    if text == "auto":
        return BufferLimit(None, auto=True)
    if text.startswith("hint+") and text[5:].isdigit():
        return BufferLimit(None, extra=int(text[5:]))
    if text.endswith("xhint") and text[:-5].isdigit() and int(text[:-5]) >= 1:
        return BufferLimit(None, factor=int(text[:-5]))
    budget = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)([a-z]+)", text)
    if budget is not None:
        number, unit = budget.groups()
        if unit not in BYTE_UNITS:
            raise ValueError(f"buffer_limit={spec!r}: unknown byte unit {unit!r}; use one of "
                             f"B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB")
        nbytes = int(float(number) * BYTE_UNITS[unit])
        if nbytes < 1:
            raise ValueError(f"buffer_limit={spec!r} is a budget of no bytes: give each "
                             "rank's activation budget, e.g. '512MiB'")
        return BufferLimit(None, budget_bytes=nbytes)
    raise ValueError(f"buffer_limit={spec!r} is not understood: {_UNDERSTOOD}")


def parse_policy(name: str | None, names: Sequence[str] | None = None) -> str | None:
    """A policy's name as ``names`` (default: ``policy_names()``) spell it, matched
    case-insensitively (as hint names are); None or an empty name: the default (None)."""
    names = policy_names() if names is None else names
    if name is not None and not isinstance(name, str):
        raise ValueError(f"policy must be a str: one of {list(names)} (case-insensitive), or "
                         f"none for the default; got {name!r}")
    if name is None or not name.strip():
        return None
    for known in names:
        if known.lower() == name.strip().lower():
            return known
    raise ValueError(f"unknown policy {name!r}: use one of {list(names)} (case-insensitive), "
                     "or none for the default")


def parse_launch_depth(depth: object) -> int | None:
    """An int >= 1, or None, 0 or ``"none"`` for no bound (None); an int may be written as
    a string."""
    if isinstance(depth, str):
        text = depth.strip().lower()
        depth = None if text == "none" else int(text) if text.isdigit() else depth
    if depth is None:
        return None
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"launch_depth must be an int >= 1, or None, 0 or 'none' for no "
                         f"bound, got {depth!r}")
    return depth or None


def parse_stall_timeout(seconds: object) -> float:
    """Seconds without any ready action before a step raises: a number > 0."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"stall_timeout must be a number of seconds > 0, got {seconds!r}")
    return float(seconds)


def parse_meter_every(every: object) -> int:
    """Meter the activations every this-many-th step: an int >= 1."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"meter_every must be an int >= 1 (1: meter every step), got {every!r}")
    return every


def check_limit_can_be_measured(spec: object, *, meter_activations: bool,
                                free_memory_known: bool, device: object) -> None:
    """ValueError where ``buffer_limit=spec`` needs what the run lacks: a limit in bytes
    the activation meter (the first step measures the bytes), ``'auto'`` a device that
    tells its free memory (``free_memory_known``; ``device``: the stages', for the
    message)."""
    limit = parse_buffer_limit(spec)
    if limit.in_bytes and not meter_activations:
        raise ValueError(
            f"buffer_limit={limit.spec!r} is counted in bytes, which the first step measures "
            "with the activation meter: leave meter_activations on (it meters only every "
            "meter_every-th step), or give the limit in microbatches")
    if limit.auto and not free_memory_known:
        raise ValueError(
            f"buffer_limit='auto' reads the free memory of a CUDA device; these stages are "
            f"on {device}: give a byte budget per rank (e.g. '512MiB') or 'busiest'")
