"""The dependency graph of one step's actions: what any schedule of a hint must respect.

Edges say "``a`` starts no earlier than ``delay`` after ``p`` ends": data dependencies
(forwards up the stages, backwards down, each W after its I, with the link latency between
ranks), and optionally the constraints RRFP adds: each stage's streams run in hint order,
and a stage holding its memory limit starts its next forward only after its next release
(the microbatch's release point) has ended. Every edge comes from the hint's plan
(``rrfp.core.plan``). The simulator's lower bounds and offline optimum, and the ``critical``
policy's priorities, are built on it.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

from rrfp.core.actions import _Action, Edge
from rrfp.core.hints import Hint
from rrfp.core.limits import MemoryLimits

Latency = Callable[[Edge, int], float]


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


def step_graph(hint: Hint, latency: Latency | None = None, *,
               limits: MemoryLimits | None = None, stream_order: bool = False) -> StepGraph:
    """The graph of ``hint``'s step (its plan's compute actions: F, B, I, W): each
    action after its producers on its rank, and after the sender of the message it
    receives plus that message's latency (``rrfp.core.plan``); with ``stream_order`` also each stage's streams in hint order; with ``limits``
    also the memory edges of each stage that is alone on its rank (there the stage's limit
    is the rank's)."""
    lat = latency or (lambda edge, mb: 0.0)
    plan = hint.plan
    preds: dict[_Action, list[tuple[_Action, float]]] = {}
    for rank_plan in plan.ranks.values():
        for n in rank_plan.nodes:
            if n.kind == "R":
                continue
            preds[n.action] = [(rank_plan.nodes[d].action, 0.0) for d in n.deps]
            if n.message is not None:
                preds[n.action].append((plan.sender(*n.message), lat(*n.message)))
    actions = tuple(preds)
    if stream_order:
        for s in range(hint.num_stages):
            for stream in ("F", "BI", "GRAD"):
                ordered = [n.action for n in plan.stream(s, stream)]
                for before, after in zip(ordered, ordered[1:]):
                    preds[after].append((before, 0.0))
    if limits is not None:
        for s in range(hint.num_stages):
            if len(hint.stages_on(plan.stage_to_rank[s])) > 1:
                continue
            forwards, releases = plan.stream(s, "F"), plan.releases(s)
            cap = limits.per_stage[s]
            for k in range(len(forwards) - cap):
                # The (k + cap)-th forward finds the stage full until k + 1 releases ended.
                preds[forwards[k + cap].action].append((releases[k], 0.0))
    return StepGraph(actions, {a: tuple(p) for a, p in preds.items()})
