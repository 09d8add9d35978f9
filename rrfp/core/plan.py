"""The lowering pass: what one step of a hint means, derived once.

In the spirit of torch's own passes over per-rank ``_Action`` lists, ``lower(hint)`` reads
the hint's orders and returns a ``StepPlan``: per rank, one ``Node`` per action with the
streams it belongs to, the actions it needs, the messages it receives and sends and whether
it lets its microbatch's activations go. Every other part reads the plan and derives none
of it: the arbiter (``rrfp.core.arbiter``) is a cursor over a rank's nodes, the step graph
(``rrfp.core.graph``) and through it the ``critical`` policy and the simulator's bounds and
optimum take their edges from it, the memory limits (``rrfp.core.limits``) their peaks, the
receive rings (``rrfp.comm.receives``) when a slot is free again. ``Hint.plan`` holds the plan of
a hint, computed on first use.

Each rule of a step is written in one function here:

* **Streams** (``_streams_of``): per stage, its forwards; its input-gradient backwards (B or
  I: the order its gradients go upstream); its weight-gradient accumulations (B or W: the
  order gradients accumulate in); and the rank's gradient reductions. Each runs in hint
  order: that is what keeps every channel's order known to both ends and every gradient
  bitwise the fixed schedule's.
* **Dependencies** (``_producers_of``): F(s, m) needs F(s-1, m)'s output; B or I(s, m) needs
  F(s, m) and the input-gradient action of (s+1, m); W(s, m) needs I(s, m); a stage's
  gradient reduction needs its last weight-gradient action.
* **Messages and hand-offs** (``_lowered_node``, ``_output_of``, ``crosses_ranks``): an
  action's output goes to the next stage (F) or the previous one (B, I): as a message on
  that edge when the stage is on another rank (``Node.sends``, ``Node.message`` at the
  consumer, ``StepPlan.remote_edges``), handed over in place when it is on the same rank
  (``Node.hands_to``).
* **Release points** (``_release_points``): a microbatch's activations on a stage are held
  from its forward until its last action there: B, or W when backward is split (after I
  autograd keeps the state W needs); in a forward-only step the forward itself.
  ``held_through`` is that accounting over any order, in microbatches or bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from rrfp.core.actions import (_Action, B, Edge, F, I, INPUT_GRAD_KINDS, Kind, kind_of,
                               WEIGHT_GRAD_KINDS)


class Orders(Protocol):
    """What the lowering pass reads of a hint (``rrfp.core.hints.Hint``)."""

    num_stages: int
    stage_to_rank: Mapping[int, int]
    orders: Mapping[int, Sequence[_Action]]


StreamKey = tuple
"""``(stage, "F")``, ``(stage, "BI")``, ``(stage, "GRAD")`` or ``("R",)``."""


@dataclass(frozen=True, eq=False)
class Node:
    """One action of a rank's hint order, lowered."""

    index: int
    """Position in the rank's hint order (its rank: lower runs first when both ready)."""
    action: _Action
    kind: Kind
    stage: int
    microbatch: int | None
    streams: tuple[int, ...]
    """Ids of the rank's streams it belongs to (``RankPlan.streams``)."""
    producers: tuple[_Action, ...]
    """The actions whose output it needs (on this rank or another)."""
    deps: tuple[int, ...]
    """Indices of the producers on this rank: launched before it (the device runs a rank's
    actions in launch order)."""
    message: tuple[Edge, int] | None
    """The message (edge, microbatch) it receives from a producer on another rank."""
    sends: tuple[Edge, ...]
    """Edges to other ranks its output leaves on once it has run."""
    hands_to: int | None
    """The stage on this rank its output goes to in place (a local hand-off, no message)."""
    releases: bool
    """Whether it is its microbatch's last action on its stage: the activations the
    microbatch holds there (and the receive slot of its input) are let go when it ends."""


@dataclass(frozen=True, eq=False)
class RankPlan:
    """One rank's lowered hint order."""

    rank: int
    stages: tuple[int, ...]
    nodes: tuple[Node, ...]
    streams: tuple[tuple[int, ...], ...]
    """Per stream id: its nodes' indices, in hint order."""
    stream_ids: Mapping[StreamKey, int]
    index_of: Mapping[_Action, int]
    held: tuple[int, ...]
    """Microbatches held by the rank's stages together after each prefix of its order
    (positions ``0..len(nodes)``)."""
    future_peaks: tuple[int, ...]
    """``[p]``: the most the rank's stages hold together from position ``p`` on."""
    forwards: Mapping[int, int]
    """Per stage: how many forwards it runs."""

    @property
    def peak(self) -> int:
        """The most the rank's stages hold together at any moment of the fixed order."""
        return self.future_peaks[0]

    def node(self, action: _Action) -> Node:
        try:
            return self.nodes[self.index_of[action]]
        except KeyError:
            raise KeyError(f"{action} is not in rank {self.rank}'s hint") from None


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Every rank's lowered hint order, and what follows from them for the whole step."""

    num_stages: int
    stage_to_rank: Mapping[int, int]
    ranks: Mapping[int, RankPlan]
    stage_peaks: Mapping[int, int]
    """Per stage: the most microbatches the fixed order holds there at once."""
    message_orders: Mapping[Edge, tuple[int, ...]]
    """Per edge between ranks: microbatches in the order its producer sends them."""

    def rank_peaks(self) -> dict[int, int]:
        """Per rank: the fixed order's peak of microbatches its stages hold together (the
        maximum over time of their sum, not the sum of their peaks)."""
        return {r: plan.peak for r, plan in self.ranks.items()}

    @cached_property
    def remote_edges(self) -> tuple[Edge, ...]:
        """Edges whose two stages live on different ranks (one channel each), in stage
        order, each forward edge before its backward twin: the order every rank builds
        the channels in."""
        return tuple(edge for s in range(self.num_stages - 1)
                     for edge in (Edge(s, s + 1), Edge(s + 1, s))
                     if crosses_ranks(edge, self.stage_to_rank))

    def message_order(self, edge: Edge) -> tuple[int, ...]:
        return self.message_orders[edge]

    def message_position(self, edge: Edge, microbatch: int) -> int:
        """Where ``microbatch`` comes in ``message_order(edge)``."""
        return self._message_positions[(edge, microbatch)]

    @cached_property
    def _message_positions(self) -> dict[tuple[Edge, int], int]:
        return {(edge, mb): i for edge, order in self.message_orders.items()
                for i, mb in enumerate(order)}

    def stream(self, stage: int, stream: str) -> tuple[Node, ...]:
        """``stage``'s ``"F"``, ``"BI"`` or ``"GRAD"`` stream, in hint order."""
        plan = self.ranks[self.stage_to_rank[stage]]
        sid = plan.stream_ids.get((stage, stream))
        return () if sid is None else tuple(plan.nodes[i] for i in plan.streams[sid])

    def releases(self, stage: int) -> tuple[_Action, ...]:
        """``stage``'s release points in hint order (``Node.releases``)."""
        plan = self.ranks[self.stage_to_rank[stage]]
        return tuple(n.action for n in plan.nodes if n.releases and n.stage == stage)

    def release_of(self, stage: int, microbatch: int) -> _Action:
        """The action that lets ``microbatch``'s activations on ``stage`` go."""
        return self._release_of[(stage, microbatch)]

    @cached_property
    def _release_of(self) -> dict[tuple[int, int], _Action]:
        return {(n.stage, n.microbatch): n.action for plan in self.ranks.values()
                for n in plan.nodes if n.releases}

    def sender(self, edge: Edge, microbatch: int) -> _Action:
        """The action whose output goes over ``edge`` (between ranks) for ``microbatch``."""
        return self._senders[(edge, microbatch)]

    @cached_property
    def _senders(self) -> dict[tuple[Edge, int], _Action]:
        return {(edge, n.microbatch): n.action for plan in self.ranks.values()
                for n in plan.nodes for edge in n.sends}

    @cached_property
    def stream_orders(self) -> dict[tuple[int, StreamKey], tuple[_Action, ...]]:
        """Per rank and stream: its actions in hint order (what fixes the order in which
        each stage computes, sends and accumulates its gradients)."""
        return {(r, key): tuple(plan.nodes[i].action for i in plan.streams[sid])
                for r, plan in self.ranks.items() for key, sid in plan.stream_ids.items()}

    def streams_share_one_order(self) -> bool:
        """Whether every stage's F and B/I streams list microbatches in one common order.

        Then backpressure is deadlock-free for any limit >= 1 (take the earliest
        in-flight microbatch: the stage after the furthest one that has run it can always
        run it next). Otherwise the limit must not go below the hint's own peak.
        """
        def order(stage: int, stream: str) -> list[int | None]:
            return [n.microbatch for n in self.stream(stage, stream)]

        common = order(0, "F")
        return all(order(s, "F") == common and order(s, "BI") in (common, [])
                   for s in range(self.num_stages))


def lower(hint: Orders) -> StepPlan:
    """Lower every rank's order of ``hint`` (use ``hint.plan``, which keeps the result)."""
    present = frozenset(a for actions in hint.orders.values() for a in actions)
    ranks = {rank: _lower_rank(hint, rank, actions, present)
             for rank, actions in hint.orders.items()}
    stage_peaks: dict[int, int] = {}
    for plan in ranks.values():
        stage_peaks.update(_stage_peaks(plan))
    messages: dict[Edge, list[int]] = {}
    for rank in sorted(ranks):
        for node in ranks[rank].nodes:
            for edge in node.sends:
                messages.setdefault(edge, []).append(node.microbatch)  # type: ignore[arg-type]
    return StepPlan(hint.num_stages, dict(hint.stage_to_rank), ranks,
                    dict(sorted(stage_peaks.items())),
                    {edge: tuple(order) for edge, order in messages.items()})


def _lower_rank(hint: Orders, rank: int, actions: Sequence[_Action],
                present: frozenset[_Action]) -> RankPlan:
    stage_to_rank = hint.stage_to_rank
    index_of = {a: i for i, a in enumerate(actions)}
    stream_ids: dict[StreamKey, int] = {}
    members: list[list[int]] = []
    last_weight_grad: dict[int, _Action] = {}
    release_points = _release_points(actions)
    nodes = []
    for i, action in enumerate(actions):
        keys = _streams_of(action)
        for key in keys:
            if key not in stream_ids:
                stream_ids[key] = len(members)
                members.append([])
            members[stream_ids[key]].append(i)
        producers = _producers_of(action, present, last_weight_grad, hint.num_stages)
        if action.computation_type in WEIGHT_GRAD_KINDS:
            last_weight_grad[action.stage_index] = action
        nodes.append(_lowered_node(i, action, producers, index_of, stage_to_rank, rank,
                                   streams=tuple(stream_ids[k] for k in keys),
                                   output=_output_of(action, stage_to_rank, hint.num_stages),
                                   releases=i in release_points))
    held = _held_after_each_prefix(nodes)
    future, running = [], 0
    for total in reversed(held):
        running = max(running, total)
        future.append(running)
    forwards: dict[int, int] = {}
    for node in nodes:
        if node.kind == "F":
            forwards[node.stage] = forwards.get(node.stage, 0) + 1
    stages = tuple(sorted(s for s, r in stage_to_rank.items() if r == rank))
    return RankPlan(rank, stages, tuple(nodes), tuple(tuple(m) for m in members), stream_ids,
                    index_of, tuple(held), tuple(reversed(future)),
                    {s: forwards.get(s, 0) for s in stages})


def _streams_of(action: _Action) -> tuple[StreamKey, ...]:
    """The streams ``action`` belongs to (see the module docstring)."""
    kind, stage = kind_of(action), action.stage_index
    keys: list[StreamKey] = []
    if kind == "F":
        keys.append((stage, "F"))
    elif kind == "BI":
        keys.append((stage, "BI"))
    elif kind == "R":
        keys.append(("R",))
    if action.computation_type in WEIGHT_GRAD_KINDS:
        keys.append((stage, "GRAD"))
    return tuple(keys)


def _producers_of(action: _Action, present: frozenset[_Action],
                  last_weight_grad: Mapping[int, _Action], num_stages: int
                  ) -> tuple[_Action, ...]:
    """The actions whose output ``action`` needs (see the module docstring); a stage's
    gradient reduction follows the stage's last weight-gradient action before it."""
    kind, s, m = kind_of(action), action.stage_index, action.microbatch_index
    if kind == "F":
        return (_Action(s - 1, F, m),) if s > 0 else ()
    if kind == "BI":
        own = (_Action(s, F, m),)
        return own + ((_input_grad(present, s + 1, m),) if s < num_stages - 1 else ())
    if kind == "W":
        return (_Action(s, I, m),)
    return (last_weight_grad[s],) if s in last_weight_grad else ()


def _input_grad(present: frozenset[_Action], stage: int, microbatch: int) -> _Action:
    """The stage's input-gradient action for the microbatch: B, or I where it is split."""
    full = _Action(stage, B, microbatch)
    return full if full in present else _Action(stage, I, microbatch)


def _lowered_node(index: int, action: _Action, producers: tuple[_Action, ...],
                  index_of: Mapping[_Action, int], stage_to_rank: Mapping[int, int],
                  rank: int, *, streams: tuple[int, ...],
                  output: tuple[tuple[Edge, ...], int | None], releases: bool) -> Node:
    """A node: its producers on this rank become dependencies, one on another rank the
    message it receives."""
    deps, message = [], None
    for producer in producers:
        edge = Edge(producer.stage_index, action.stage_index)
        if crosses_ranks(edge, stage_to_rank):
            message = (edge, action.microbatch_index)
        elif producer in index_of:
            deps.append(index_of[producer])
        else:
            raise ValueError(f"rank {rank}'s hint runs {action} but not {producer}, "
                             "which it needs")
    return Node(index, action, kind_of(action), action.stage_index, action.microbatch_index,
                streams, producers, tuple(deps), message, *output, releases)


def _output_of(action: _Action, stage_to_rank: Mapping[int, int],
               num_stages: int) -> tuple[tuple[Edge, ...], int | None]:
    """Where ``action``'s output goes: the edges to other ranks it leaves on, and the
    stage of its own rank it is handed to in place."""
    s, ctype = action.stage_index, action.computation_type
    if ctype == F:
        edge = Edge(s, s + 1)
    elif ctype in INPUT_GRAD_KINDS:
        edge = Edge(s, s - 1)
    else:
        return (), None
    if not 0 <= edge.dst < num_stages:
        return (), None
    if crosses_ranks(edge, stage_to_rank):
        return (edge,), None
    return (), edge.dst


def crosses_ranks(edge: Edge, stage_to_rank: Mapping[int, int]) -> bool:
    """Whether ``edge``'s two stages live on different ranks: a message, not a hand-off."""
    return stage_to_rank[edge.src] != stage_to_rank[edge.dst]


def _release_points(actions: Sequence[_Action]) -> frozenset[int]:
    """Positions of each microbatch's last action on its stage (see the module docstring)."""
    last: dict[tuple[int, int], int] = {}
    for i, action in enumerate(actions):
        if action.microbatch_index is not None:
            last[(action.stage_index, action.microbatch_index)] = i
    return frozenset(last.values())


def held_through(nodes: Iterable[Node], key: Callable[[Node], Hashable] = lambda node: None,
                 amount: Callable[[Node], int] = lambda node: 1,
                 ) -> Iterator[tuple[Node, int, int]]:
    """The held-activation accounting, written once: running ``nodes`` in order, a forward
    adds ``amount(node)`` to its ``key(node)``'s total and the node at a microbatch's
    release point takes that microbatch's amount away. Yields, per node, its key's total
    while the node runs (its peak) and after it."""
    totals: dict[Hashable, int] = {}
    for node in nodes:
        k = key(node)
        total = totals.get(k, 0) + (amount(node) if node.kind == "F" else 0)
        during = total
        if node.releases:
            total -= amount(node)
        totals[k] = total
        yield node, during, total


def _held_after_each_prefix(nodes: Sequence[Node]) -> list[int]:
    """Microbatches the rank's stages hold together after each prefix of the order."""
    return [0, *(after for _, _, after in held_through(nodes))]


def _stage_peaks(plan: RankPlan) -> dict[int, int]:
    """Per stage of the rank: the most microbatches the fixed order holds there at once."""
    peaks = {s: 0 for s in plan.stages}
    for node, during, _ in held_through(plan.nodes, key=lambda node: node.stage):
        peaks[node.stage] = max(peaks[node.stage], during)
    return peaks
