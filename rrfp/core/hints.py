"""Hints: turn any pipeline-schedule source into validated per-rank action orders.

A hint is what each pipeline rank would run under a fixed schedule: an ordered list of
torch ``_Action`` s per rank. RRFP treats it as a ranking, not a contract, but two things
in it are binding because both ends of every channel must agree on them in advance:

* the order of each *stream* (``rrfp.core.plan``): per stage, its forwards (F), its
  input-gradient backwards (B or I: they send gradients upstream), and its weight-gradient
  accumulations (B or W);
* the stage-to-rank placement.

What a step of the hint means (dependencies, messages, release points, the memory it
holds) is derived from the orders once, by ``rrfp.core.plan.lower`` (``Hint.plan``).

Sources: a torch schedule name or class, a CSV in torch's compute-only format, a
``{rank: [_Action | None, ...]}`` dict, or the paper's rules ``"BF"`` / ``"BFW"`` (whose
streams and memory reference come from the fixed schedule they are compared against).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from types import SimpleNamespace
from typing import Literal, Union

from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import (
    _add_send_recv,
    _PipelineSchedule,
    _ScheduleForwardOnly,
    _validate_schedule,
    get_schedule_class,
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from rrfp._torch_compat import add_reduce_grad, is_bookkeeping
from rrfp.core.actions import _Action, _ComputationType, B, F, I, OVERLAP_F_B, W
from rrfp.core.plan import lower, StepPlan

Policy = Literal["hint", "BF", "BFW"]
Layout = Literal["loop", "v", "custom"]
HintSource = Union[str, os.PathLike, type, Mapping[int, Sequence[Union[_Action, str, None]]]]

TORCH_SCHEDULE_NAMES = (
    "1F1B",
    "GPipe",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
RULE_NAMES = ("BF", "BFW")
HINT_NAMES = TORCH_SCHEDULE_NAMES + RULE_NAMES


@dataclass(frozen=True)
class Hint:
    """A validated hint: the fixed per-rank order RRFP ranks ready actions by."""

    name: str
    """Where the hint came from, for logs and errors (e.g. ``"Interleaved1F1B"``)."""
    policy: Policy
    """``"hint"``: rank ready actions by position in ``orders``; ``"BF"``/``"BFW"``: the
    paper's rules (``orders`` then only fixes the streams and the memory reference)."""
    num_ranks: int
    num_stages: int
    n_microbatches: int
    stage_to_rank: Mapping[int, int]
    orders: Mapping[int, tuple[_Action, ...]]
    """Per rank: compute actions (F, B, I, W) and REDUCE_GRAD, in hint order, no idles."""

    def stages_on(self, rank: int) -> tuple[int, ...]:
        return tuple(sorted(s for s, r in self.stage_to_rank.items() if r == rank))

    @property
    def layout(self) -> Layout:
        for style in ("loop", "v"):
            try:
                expected = generate_stage_to_rank_mapping(
                    self.num_ranks, self.num_stages, style=style
                )
            except ValueError:
                continue
            if expected == dict(self.stage_to_rank):
                return style  # type: ignore[return-value]
        return "custom"

    @cached_property
    def has_split_backward(self) -> bool:
        return any(a.computation_type == W for acts in self.orders.values() for a in acts)

    def forward_only(self) -> Hint:
        """The same hint for a step without backward (``eval``): forwards only."""
        return Hint(
            name=self.name,
            policy=self.policy,
            num_ranks=self.num_ranks,
            num_stages=self.num_stages,
            n_microbatches=self.n_microbatches,
            stage_to_rank=self.stage_to_rank,
            orders={
                r: tuple(a for a in acts if a.computation_type == F)
                for r, acts in self.orders.items()
            },
        )

    @cached_property
    def plan(self) -> StepPlan:
        """What one step of this hint means (``rrfp.core.plan.lower``), derived on first use."""
        return lower(self)

    def with_communication(self) -> dict[int, list[_Action]]:
        """Per rank, the hint's order with the sends and receives torch's lowering adds
        (what torch's runtime would run for it; RRFP derives its communication itself)."""
        return _add_send_recv({r: list(acts) for r, acts in self.orders.items()},
                              stage_to_rank=lambda s: self.stage_to_rank[s],
                              num_stages=self.num_stages)

    def format(self) -> str:
        return "\n".join(
            f"rank {r}: " + " ".join(str(a) for a in self.orders[r])
            for r in sorted(self.orders)
        )


def infer_layout(
    rank: int, num_ranks: int, num_stages: int, local_stages: Sequence[int]
) -> Layout:
    """Which standard placement the rank's stages follow (``"custom"`` if neither)."""
    for style in ("loop", "v"):
        try:
            mapping = generate_stage_to_rank_mapping(num_ranks, num_stages, style=style)
        except ValueError:
            continue
        if sorted(local_stages) == sorted(s for s, r in mapping.items() if r == rank):
            return style  # type: ignore[return-value]
    return "custom"


def build_hint(
    source: HintSource,
    *,
    num_ranks: int,
    num_stages: int,
    n_microbatches: int,
    layout: Layout = "loop",
    given_name: str | None = None,
) -> Hint:
    """Build and validate a hint.

    ``layout`` is the stage placement of the pipeline; it only chooses the reference
    schedule of the ``"BF"``/``"BFW"`` rules (other sources fix their own placement).
    ``given_name``: what logs and errors call the hint (default: after its source).
    Raises ``ValueError`` saying what to change when the source is unknown, malformed, or
    does not fit the pipeline.
    """
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
    shape = dict(num_ranks=num_ranks, num_stages=num_stages, n_microbatches=n_microbatches)
    policy: Policy = "hint"
    if isinstance(source, str) and source.upper() in RULE_NAMES:
        policy = source.upper()  # type: ignore[assignment]
        name = policy
        orders = _torch_schedule_orders(
            rule_reference(policy, layout, num_stages // num_ranks), **shape)
    elif isinstance(source, str) and source.lower() in {n.lower() for n in TORCH_SCHEDULE_NAMES}:
        schedule_class = get_schedule_class(source)
        name = schedule_class.__name__.removeprefix("Schedule")
        orders = _torch_schedule_orders(schedule_class, **shape)
    elif isinstance(source, type):
        if not issubclass(source, _PipelineSchedule):
            raise ValueError(
                f"hint class {source.__name__} is not a torch.distributed.pipelining schedule"
            )
        name = source.__name__
        orders = _torch_schedule_orders(source, **shape)
    elif isinstance(source, Mapping):
        name = "custom"
        orders = _parse_orders(source)
    elif isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        name = os.path.basename(os.fspath(source))
        orders = read_csv(source)
    elif isinstance(source, os.PathLike) or (
            isinstance(source, str) and (source.lower().endswith(".csv") or os.sep in source)):
        raise ValueError(f"hint file {os.fspath(source)!r} not found: give the path to a CSV "
                         "in torch's compute-only format (or a hint name)")
    else:
        raise ValueError(
            f"unknown hint {source!r}: expected one of {list(HINT_NAMES)} "
            "(case-insensitive), a path to a CSV file in torch's compute-only format, "
            "a torch schedule class, or a {rank: [_Action | None, ...]} dict"
        )
    return _validated(given_name or name, policy, orders, **shape)


def interchangeable(hint: Hint, other: Hint) -> bool:
    """Whether ``other`` may rank a step of a run built for ``hint``: the same stages on the
    same ranks (the channels were built for them), the same microbatches, and the same
    actions in the same order in every stream (each stage computes, sends and accumulates
    its gradients in the same order, so the gradients are the same to the bit)."""
    return (dict(hint.stage_to_rank) == dict(other.stage_to_rank)
            and hint.n_microbatches == other.n_microbatches
            and hint.plan.stream_orders == other.plan.stream_orders)


def interchangeable_hints(hint: Hint) -> dict[str, Hint]:
    """The named hints (``HINT_NAMES``), built for ``hint``'s ranks, stages and
    microbatches, that are ``interchangeable`` with it and rank differently from it and
    from each other (the first name of each ranking), by name."""
    found: dict[str, Hint] = {}
    rankings = {(hint.policy, tuple(sorted(hint.orders.items())))}
    for name in HINT_NAMES:
        try:
            other = build_hint(name, num_ranks=hint.num_ranks, num_stages=hint.num_stages,
                               n_microbatches=hint.n_microbatches, layout=hint.layout)
        except ValueError:  # a schedule that does not fit this shape
            continue
        ranking = (other.policy, tuple(sorted(other.orders.items())))
        if ranking not in rankings and interchangeable(hint, other):
            rankings.add(ranking)
            found[other.name] = other
    return found


SPLIT_BACKWARD_SCHEDULES = (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
                            ScheduleDualPipeV)
"""torch's schedules with split backward (I and W), which refuse compiled stages first."""


def declares_split_backward(source: HintSource) -> bool:
    """Whether ``source`` names a rule or torch schedule that splits backward (I/W), before
    the hint is built (a CSV or dict shows it only once built: ``Hint.has_split_backward``)."""
    if isinstance(source, str) and source.upper() == "BFW":
        return True
    if isinstance(source, str) and source.lower() in {n.lower() for n in TORCH_SCHEDULE_NAMES}:
        source = get_schedule_class(source)
    return isinstance(source, type) and issubclass(source, SPLIT_BACKWARD_SCHEDULES)


def _validated(
    name: str,
    policy: Policy,
    raw_orders: Mapping[int, Sequence[_Action | None]],
    *,
    num_ranks: int,
    num_stages: int,
    n_microbatches: int,
) -> Hint:
    orders = {r: _flatten_compute(acts) for r, acts in raw_orders.items()}
    try:
        stage_to_rank = _validate_schedule(
            orders, num_ranks, num_stages, n_microbatches  # type: ignore[arg-type]
        )
    except AssertionError as e:
        raise ValueError(
            f"hint {name!r} does not fit a pipeline of {num_ranks} ranks, {num_stages} "
            f"stages and {n_microbatches} microbatches: {str(e).splitlines()[0]}"
        ) from None
    if sorted(stage_to_rank) != list(range(num_stages)):
        missing = sorted(set(range(num_stages)) - set(stage_to_rank))
        raise ValueError(f"hint {name!r} never runs stages {missing}")
    _check_stream_orders(name, orders)
    with_reduce = {r: tuple(add_reduce_grad(acts, n_microbatches)) for r, acts in orders.items()}
    return Hint(
        name=name,
        policy=policy,
        num_ranks=num_ranks,
        num_stages=num_stages,
        n_microbatches=n_microbatches,
        stage_to_rank=dict(stage_to_rank),
        orders=with_reduce,
    )


def _flatten_compute(actions: Sequence[_Action | None]) -> list[_Action]:
    """Drop idles and gradient-reduction actions (re-added uniformly); unfold OVERLAP_F_B
    as torch runs it."""
    flat: list[_Action] = []
    for a in actions:
        if a is None or is_bookkeeping(a):
            continue
        if a.computation_type == OVERLAP_F_B:
            flat.extend(a.sub_actions or ())
        elif a.computation_type in (F, B, I, W):
            flat.append(a)
        else:
            raise ValueError(
                f"hint action {a} is not a compute action: give the compute-only "
                "schedule (F, B, I, W); RRFP derives all communication itself"
            )
    return flat


def _check_stream_orders(name: str, orders: Mapping[int, Sequence[_Action]]) -> None:
    """No action twice (torch's validation counts with sets and would not notice)."""
    for rank, acts in orders.items():
        seen: set[tuple[int, _ComputationType, int | None]] = set()
        for a in acts:
            key = (a.stage_index, a.computation_type, a.microbatch_index)
            if key in seen:
                raise ValueError(f"hint {name!r} runs {a} twice on rank {rank}")
            seen.add(key)


def _one_stage_per_rank_check(name: str, num_ranks: int, num_stages: int) -> None:
    if num_stages != num_ranks:
        raise ValueError(
            f"hint {name!r} runs one stage per rank, but this pipeline has "
            f"{num_stages // num_ranks} stages per rank ({num_stages} stages on "
            f"{num_ranks} ranks): use a multi-stage hint such as Interleaved1F1B, "
            "ZBVZeroBubble or BF, or build one stage per rank"
        )


def rule_reference(rule: str, layout: Layout, stages_per_rank: int) -> type:
    """The torch schedule a BF/BFW rule takes its streams and memory budget from (and the
    fixed schedule it is compared with): 1F1B or Interleaved1F1B for BF,
    InterleavedZeroBubble (loop) or ZBVZeroBubble (V) for BFW."""
    if layout == "v":
        if rule == "BF":
            raise ValueError(
                "the BF rule needs a loop placement (stage s on rank s % pp_size); for "
                "V-placed stages use BFW, ZBVZeroBubble or DualPipeV"
            )
        return ScheduleZBVZeroBubble
    if layout != "loop":
        raise ValueError(f"the {rule} rule needs a loop or V stage placement, not a custom one")
    if rule == "BFW":
        return ScheduleInterleavedZeroBubble
    return Schedule1F1B if stages_per_rank == 1 else ScheduleInterleaved1F1B


def _torch_schedule_orders(
    schedule_class: type, *, num_ranks: int, num_stages: int, n_microbatches: int
) -> dict[int, list[_Action | None]]:
    """Per-rank compute order of a torch schedule class, without any process group."""
    name = schedule_class.__name__.removeprefix("Schedule")
    if num_stages % num_ranks != 0 and schedule_class.__module__ == _PipelineSchedule.__module__:
        raise ValueError(f"{num_stages} stages do not divide evenly over {num_ranks} pipeline "
                         f"ranks, as torch's {name} needs: give a CSV or dict hint that "
                         "places them")
    if schedule_class is _ScheduleForwardOnly:
        # It runs GPipe's forwards, in microbatch order, and no backward.
        schedule_class = ScheduleGPipe
    if schedule_class is Schedule1F1B:
        _one_stage_per_rank_check(name, num_ranks, num_stages)
        if n_microbatches < num_stages:
            raise ValueError(
                f"hint '1F1B' needs at least as many microbatches as stages: got "
                f"{n_microbatches} microbatches for {num_stages} stages"
            )
        return {r: _torch_1f1b_order(r, num_ranks, n_microbatches) for r in range(num_ranks)}
    if schedule_class in (PipelineScheduleSingle, PipelineScheduleMulti):
        raise ValueError(f"{name} is a base class, not a schedule: pick a concrete hint")

    def stage_proxy(index: int) -> SimpleNamespace:
        # What torch's schedule constructors read from a stage; they compute every
        # rank's order, so rank 0's view is enough.
        return SimpleNamespace(
            stage_index=index, num_stages=num_stages, group_size=num_ranks, group_rank=0,
            submod=None,
        )

    try:
        if issubclass(schedule_class, PipelineScheduleSingle):
            _one_stage_per_rank_check(name, num_ranks, num_stages)
            schedule = schedule_class(stage_proxy(0), n_microbatches, loss_fn=_no_loss)
        else:
            stages_per_rank = num_stages // num_ranks
            schedule = schedule_class(
                [stage_proxy(i) for i in range(stages_per_rank)], n_microbatches,
                loss_fn=_no_loss,
            )
    except (ValueError, AssertionError, RuntimeError) as e:
        raise ValueError(
            f"hint {name!r} does not fit {num_ranks} ranks x "
            f"{num_stages // num_ranks} stages per rank with {n_microbatches} "
            f"microbatches: {e}"
        ) from None
    # A runtime schedule may give only its order with communication.
    order = schedule.pipeline_order or compute_actions(
        getattr(schedule, "pipeline_order_with_comms", None) or {})
    if not order:
        raise ValueError(f"schedule class {name} does not expose a pipeline_order to follow")
    return dict(order)


def compute_actions(
    orders: Mapping[int, Sequence[_Action | None]],
) -> dict[int, list[_Action | None]]:
    """``orders`` without communication (sends, receives, FSDP unshard/reshard and other
    bookkeeping): a schedule in torch's compute+comms format as a compute-only one."""
    return {rank: [a for a in actions if a is None or a.is_compute_op or is_bookkeeping(a)]
            for rank, actions in orders.items()}


def _torch_1f1b_order(stage: int, num_stages: int, n_microbatches: int) -> list[_Action | None]:
    """The order torch's ``Schedule1F1B._step_microbatches`` runs on ``stage``.

    (Its ``_get_pipeline_order`` in torch 2.13 mislabels microbatches on non-first
    ranks, so it is not used.)
    """
    warmup = min(n_microbatches, num_stages - stage)
    order: list[_Action | None] = [_Action(stage, F, m) for m in range(warmup)]
    forwards, backwards = warmup, 0
    while backwards < n_microbatches:
        order.append(_Action(stage, B, backwards))
        backwards += 1
        if forwards < n_microbatches:
            order.append(_Action(stage, F, forwards))
            forwards += 1
    return order


def _no_loss(output, target):  # pragma: no cover - never called: only orders are read
    raise AssertionError("hint construction never runs a loss")


def _parse_orders(
    source: Mapping[int, Sequence[_Action | str | None]],
) -> dict[int, list[_Action | None]]:
    orders: dict[int, list[_Action | None]] = {}
    for rank, actions in source.items():
        parsed: list[_Action | None] = []
        for a in actions:
            if a is None or isinstance(a, _Action):
                parsed.append(a)
            elif isinstance(a, str):
                parsed.append(_parse_action(a, f"rank {rank}"))
            else:
                raise ValueError(f"hint rank {rank}: {a!r} is not an _Action, str or None")
        orders[int(rank)] = parsed
    return orders


def read_csv(path: str | os.PathLike) -> dict[int, list[_Action | None]]:
    """The per-rank actions of a CSV in torch's format (one row per rank)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return {
        rank: [_parse_action(cell, f"{path}: row {rank + 1}") for cell in row]
        for rank, row in enumerate(rows)
    }


def _parse_action(text: str, where: str) -> _Action | None:
    try:
        return _Action.from_str(text)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"{where}: {text!r} is not an action like '0F1', '2B0', '1I3' or '1W3'"
        ) from None
