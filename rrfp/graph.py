"""The dependency graph of one step's actions: what any schedule of a hint must respect.

Edges say "``a`` starts no earlier than ``delay`` after ``p`` ends": data dependencies
(forwards up the stages, backwards down, each W after its I, with the link latency between
ranks), and optionally the constraints RRFP adds: each stage's streams run in hint order,
and a stage holding its memory limit starts its next forward only after its next release
(the microbatch's last backward piece) has ended. The simulator's lower bounds and offline
optimum, and the ``critical`` policy's priorities, are built on it.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Container
from dataclasses import dataclass

from rrfp.arbiter import MemoryLimits
from rrfp.hints import (
    _Action, B, Edge, F, Hint, I, INPUT_GRAD_KINDS, W, WEIGHT_GRAD_KINDS)

Latency = Callable[[Edge, int], float]
COMPUTE = (F, B, I, W)


@dataclass(frozen=True)
class StepGraph:
    actions: tuple[_Action, ...]
    """The step's compute actions (F, B, I, W)."""
    predecessors: dict[_Action, tuple[tuple[_Action, float], ...]]
    """Per action: (predecessor, delay) pairs."""

    def topological_order(self) -> list[_Action]:
        successors: dict[_Action, list[_Action]] = defaultdict(list)
        missing = {a: len(self.predecessors[a]) for a in self.actions}
        for a in self.actions:
            for p, _ in self.predecessors[a]:
                successors[p].append(a)
        ready = deque(a for a in self.actions if missing[a] == 0)
        order = []
        while ready:
            a = ready.popleft()
            order.append(a)
            for b in successors[a]:
                missing[b] -= 1
                if missing[b] == 0:
                    ready.append(b)
        if len(order) != len(self.actions):
            raise ValueError("the step's constraints form a cycle: no schedule satisfies them")
        return order

    def sender(self, edge: Edge, microbatch: int) -> _Action:
        """The action whose output goes over ``edge`` for ``microbatch``."""
        if edge.is_forward:
            return _Action(edge.src, F, microbatch)
        return _input_grad(self.predecessors, edge.src, microbatch)

    def longest_path(self, duration: Callable[[_Action], float]) -> tuple[dict, dict]:
        """(head, tail) per action: the longest chain of work and delays that must come
        before its start, and after its end."""
        order = self.topological_order()
        head: dict[_Action, float] = {}
        for a in order:
            head[a] = max((head[p] + duration(p) + d for p, d in self.predecessors[a]),
                          default=0.0)
        successors: dict[_Action, list[tuple[_Action, float]]] = defaultdict(list)
        for a in self.actions:
            for p, d in self.predecessors[a]:
                successors[p].append((a, d))
        tail: dict[_Action, float] = {}
        for a in reversed(order):
            tail[a] = max((d + duration(c) + tail[c] for c, d in successors[a]), default=0.0)
        return head, tail


def _input_grad(present: Container[_Action], stage: int, microbatch: int) -> _Action:
    """The stage's input-gradient action for the microbatch: B, or I where it is split."""
    full = _Action(stage, B, microbatch)
    return full if full in present else _Action(stage, I, microbatch)


def step_graph(hint: Hint, latency: Latency | None = None, *,
               limits: MemoryLimits | None = None, stream_order: bool = False) -> StepGraph:
    """The graph of ``hint``'s step: data dependencies; with ``stream_order`` also each
    stage's streams in hint order; with ``limits`` also the memory edges of each stage that
    is alone on its rank (there the stage's limit is the rank's)."""
    lat = latency or (lambda edge, mb: 0.0)
    rank_of = hint.stage_to_rank
    actions = tuple(a for acts in hint.orders.values() for a in acts
                    if a.computation_type in COMPUTE)
    present = set(actions)

    def delay(src: int, dst: int, mb: int) -> float:
        return 0.0 if rank_of[src] == rank_of[dst] else lat(Edge(src, dst), mb)

    def release(s: int, mb: int) -> _Action:
        full = _Action(s, B, mb)
        return full if full in present else _Action(s, W, mb)

    preds: dict[_Action, list[tuple[_Action, float]]] = {a: [] for a in actions}
    for a in actions:
        s, m, ctype = a.stage_index, a.microbatch_index, a.computation_type
        if ctype == F:
            if s > 0:
                preds[a].append((_Action(s - 1, F, m), delay(s - 1, s, m)))
        elif ctype == W:
            preds[a].append((_Action(s, I, m), 0.0))
        else:
            preds[a].append((_Action(s, F, m), 0.0))
            if s < hint.num_stages - 1:
                preds[a].append((_input_grad(present, s + 1, m), delay(s + 1, s, m)))
    if stream_order:
        for s in range(hint.num_stages):
            for kinds in (frozenset({F}), INPUT_GRAD_KINDS, WEIGHT_GRAD_KINDS):
                stream = [a for a in hint.orders[rank_of[s]]
                          if a.stage_index == s and a.computation_type in kinds]
                for before, after in zip(stream, stream[1:]):
                    preds[after].append((before, 0.0))
    if limits is not None:
        for s in range(hint.num_stages):
            if len(hint.stages_on(rank_of[s])) > 1:
                continue
            forwards = hint.stream(s, frozenset({F}))
            releases = hint.stream(s, WEIGHT_GRAD_KINDS)
            cap = limits.per_stage[s]
            for k in range(len(forwards) - cap):
                # The (k + cap)-th forward finds the stage full until k + 1 releases ended.
                preds[_Action(s, F, forwards[k + cap])].append((release(s, releases[k]), 0.0))
    return StepGraph(actions, {a: tuple(p) for a, p in preds.items()})
