"""The ready-set arbiter: which action one pipeline rank runs next.

Pure Python and free of torch.distributed, so the runtime (``rrfp.runtime.schedule``) and the
simulator (``rrfp.sim``) drive this very class. It knows the rank's streams, what is done,
which messages have arrived and the backpressure state, and answers "what runs next?"
in O(streams).

Correctness rests on one rule: an action may run only at the head of each of its streams
(per stage: forwards; input-gradient backwards B/I; weight-gradient accumulations B/W).
So every channel carries messages in an order both ends know, and gradients accumulate
in the hint's order: RRFP's results are bitwise those of the fixed schedule. Only the
interleaving of streams is decided at run time, by a policy (``rrfp.core.policy``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TYPE_CHECKING

from rrfp.core.actions import _Action, describe, Edge, Kind
from rrfp.core.limits import MemoryLimits
from rrfp.core.plan import Node, RankPlan

if TYPE_CHECKING:
    from rrfp.core.hints import Hint


@dataclass(frozen=True)
class Wait:
    """Why a stream head cannot run yet."""

    action: _Action
    reason: str
    peer_stage: int | None = None
    peer_rank: int | None = None
    """Pipeline rank (index in the PP group) the message comes from."""
    message: tuple[Edge, int] | None = None
    """The message waited for: its edge and microbatch."""

    def __str__(self) -> str:
        return f"{describe(self.action)} waits for {self.reason}"


def _by_index(node: Node) -> int:
    return node.index


class ArbiterView(Protocol):
    """What a policy may read of the arbiter (``Arbiter`` is one): read-only, so that
    policies depend on the arbiter and never the other way (hints <- arbiter <- policy)."""

    @property
    def hint(self) -> Hint: ...
    @property
    def rank(self) -> int: ...
    @property
    def nodes(self) -> Sequence[Node]:
        """The rank's hint order, one node per action."""
        ...
    @property
    def first_undone(self) -> int:
        """Hint position of the first action not yet launched (the fixed order's next)."""
        ...
    @property
    def memory_limits(self) -> MemoryLimits | None: ...
    @property
    def below_hint_memory(self) -> bool: ...
    @property
    def last_kind(self) -> Kind | None: ...
    @property
    def arrival_times(self) -> Mapping[tuple[Edge, int], float]: ...
    def has_arrived(self, message: tuple[Edge, int]) -> bool: ...
    def next_pending_backward(self) -> int: ...
    def stream_head(self, stage: int, stream: str) -> Node | None: ...
    def stream_heads(self) -> list[Node]: ...


class Policy(Protocol):
    """How a rank picks among ready actions (``rrfp.core.policy`` holds the policies)."""

    name: str

    def choose(self, ready: Sequence[Node], arbiter: ArbiterView) -> Node | None:
        """Pick one of ``ready`` (sorted by hint position), or None to wait."""
        ...

    def lead(self, arbiter: ArbiterView) -> int:
        """Hint position of the action this policy would run next were every action
        ready: the only one the step loop launches ahead of a busy device."""
        ...


class Arbiter:
    """Ready-set bookkeeping and choice for one rank during one step.

    ``limits``: microbatches of activations the rank may hold, per stage and in all (see
    ``resolve_buffer_limits`` for why any accepted limit is deadlock-free); ``None`` for no
    cap (forward-only steps). ``policy``: how to pick among ready actions
    (``rrfp.core.policy.make_policy``).
    """

    def __init__(
        self,
        hint: Hint,
        rank: int,
        *,
        policy: Policy,
        limits: MemoryLimits | None = None,
    ):
        self.hint = hint
        self.rank = rank
        self.memory_limits = limits
        self.plan: RankPlan = hint.plan.ranks[rank]
        local = self.plan.stages
        self.limits = {s: limits.per_stage[s] for s in local} if limits is not None else None
        self.rank_limit = limits.per_rank[rank] if limits is not None else None
        peaks = hint.plan.stage_peaks
        # Below the hint's own peak the fixed order itself would stall on backpressure,
        # so "the hint's next action is always allowed" no longer guarantees progress.
        self.below_hint_memory = self.limits is not None and any(
            self.limits[s] < peaks[s] for s in self.limits)
        self.policy = policy
        self.nodes: Sequence[Node] = self.plan.nodes
        self._streams = self.plan.streams
        self._stream_ids = self.plan.stream_ids
        self._index_of = self.plan.index_of
        self._heads = [0] * len(self._streams)
        self._done = [False] * len(self.nodes)
        self._arrived: set[tuple[Edge, int]] = set()
        self._changes = 0
        """Deliveries and launches so far: ``ready()`` is recomputed when they change."""
        self._ready: list[Node] = []
        self._ready_of = -1
        self.arrival_times: dict[tuple[Edge, int], float] = {}
        self._remaining = len(self.nodes)
        self.first_undone = 0
        self._pending_backward = 0
        self.in_flight = {s: 0 for s in local}
        """Per stage: microbatches held (forwards launched, last backward piece not)."""
        self.peak_in_flight = {s: 0 for s in local}
        self.held = 0
        """Microbatches held by all the rank's stages."""
        self.peak_held = 0
        self._future_peak = self.plan.future_peaks
        self._forwards_ahead = 0
        """Forwards launched at hint positions after ``first_undone``."""
        self._forwards_left = dict(self.plan.forwards)
        self.backpressure_entries = {s: 0 for s in local}
        self.out_of_order = 0
        self.realized: list[_Action] = []
        self.last_kind: Kind | None = None
        """Kind of the last forward or backward run ("F" or "BI"; None before any)."""

    # ----------------------------------------------------------------- queries
    @property
    def finished(self) -> bool:
        return self._remaining == 0

    def position(self, action: _Action) -> int:
        """The action's position in this rank's hint order."""
        return self._node_of(action).index

    def lead(self) -> int:
        """Hint position of the action to run next were every action ready: a gradient
        reduction that is ready (``choose`` runs those first), else the policy's lead."""
        reduce = self._head(("R",))
        if reduce is not None and self._block(reduce) is None:
            return reduce.index
        return self.policy.lead(self)

    def may_run(self, action: _Action) -> bool:
        """Whether ``action`` is ready to run now (head of its streams, inputs there)."""
        node = self._node_of(action)
        return not self._done[node.index] and self._block(node) is None

    def has_arrived(self, message: tuple[Edge, int]) -> bool:
        return message in self._arrived

    def next_pending_backward(self) -> int:
        """Hint position of the first backward (B/I) not yet run (len(nodes) if none)."""
        while self._pending_backward < len(self.nodes) and (
                self.nodes[self._pending_backward].kind != "BI"
                or self._done[self._pending_backward]):
            self._pending_backward += 1
        return self._pending_backward

    def stream_head(self, stage: int, stream: str) -> Node | None:
        """Next action of ``stage``'s ``"F"``, ``"BI"`` or ``"GRAD"`` stream (None: done)."""
        return self._head((stage, stream))

    def _head(self, key: tuple) -> Node | None:
        sid = self._stream_ids.get(key)
        if sid is None or self._heads[sid] >= len(self._streams[sid]):
            return None
        return self.nodes[self._streams[sid][self._heads[sid]]]

    def stream_heads(self) -> list[Node]:
        return [
            self.nodes[members[head]]
            for members, head in zip(self._streams, self._heads)
            if head < len(members)
        ]

    def _blocked_by(self, node: Node) -> Wait | None:
        """The first thing ``node`` waits for, explained, or None if it may run now."""
        block = self._block(node)
        if block is None:
            return None
        reason, waited = block
        if reason == "order":
            return Wait(node.action,
                        f"{describe(self.nodes[waited].action)} to run first (stream order)")
        if reason == "dependency":
            return Wait(node.action, f"{describe(self.nodes[waited].action)} on this rank")
        if reason == "message":
            edge, _ = waited
            what = "input activation" if edge.is_forward else "output gradient"
            peer = self.hint.stage_to_rank[edge.src]
            return Wait(node.action, f"its {what} from stage {edge.src} on pipeline rank {peer}",
                        peer_stage=edge.src, peer_rank=peer, message=waited)
        limit = self.limits[node.stage]  # type: ignore[index]
        return Wait(node.action, f"a backward of stage {node.stage} or another of this "
                    f"rank's stages (backpressure: the stage holds "
                    f"{self.in_flight[node.stage]} microbatches, limit {limit}; the rank "
                    f"{self.held}, limit {self.rank_limit}; "
                    f"{self._forwards_ahead} forwards ahead of the hint)")

    def _block(self, node: Node) -> tuple[str, object] | None:
        """What ``node`` waits for first, as ``(reason, what)``: ``"order"`` (the stream
        head before it), ``"dependency"`` (a local action), ``"message"`` (an edge and
        microbatch) or ``"memory"``; None if it may run now. The one readiness rule:
        ``ready`` and ``record_launch`` test it, ``waits`` explains it (hot path: no text)."""
        streams, heads = self._streams, self._heads
        for sid in node.streams:
            head = streams[sid][heads[sid]]
            if head != node.index:
                return "order", head
        done = self._done
        for dep in node.deps:
            if not done[dep]:
                return "dependency", dep
        if node.message is not None and node.message not in self._arrived:
            return "message", node.message
        if node.kind == "F" and self.limits is not None and not self._fits(node):
            return "memory", None
        return None

    def _fits(self, node: Node) -> bool:
        """Whether forward ``node`` may run within the memory limits.

        Per stage and per rank under the limit; and a forward ahead of the hint's next
        action only if the forwards run ahead, one more, still leave the rank room for the
        most the fixed order will hold from that next action on (so that the hint's next
        action always fits: see ``resolve_buffer_limits``).
        """
        if self.in_flight[node.stage] >= self.limits[node.stage]:  # type: ignore[index]
            return False
        if self.held >= self.rank_limit:  # type: ignore[operator]
            return False
        return node.index == self.first_undone or (
            self._forwards_ahead + 1 <= self.rank_limit - self._future_peak[self.first_undone])

    def ready(self) -> list[Node]:
        """Actions that may run now, in hint order (do not modify the list)."""
        # What may run changes only with deliver and record_launch; the step loop asks
        # again after a completion, which changes neither.
        if self._ready_of == self._changes:
            return self._ready
        ready = [n for n in self.stream_heads() if self._block(n) is None]
        if len(ready) > 1:
            ready.sort(key=_by_index)
        self._ready, self._ready_of = ready, self._changes
        return ready

    def waits(self) -> list[Wait]:
        """What every blocked stream head waits for (for stall reports)."""
        return [w for n in sorted(self.stream_heads(), key=lambda n: n.index)
                if (w := self._blocked_by(n)) is not None]

    # ----------------------------------------------------------------- updates
    def choose(self) -> _Action | None:
        """The action to run next, or None when nothing may run now."""
        ready = self.ready()
        if not ready:
            return None
        # Gradient reduction first: it is cheap to issue and its fixed stage order is
        # what keeps data-parallel collectives matched across replicas.
        for node in ready:
            if node.kind == "R":
                return node.action
        chosen = self.policy.choose(ready, self)
        return chosen.action if chosen is not None else None

    def deliver(self, edge: Edge, microbatch: int, at: float | None = None) -> None:
        """A message on ``edge`` for ``microbatch`` has arrived (``at``: when, if known)."""
        self._arrived.add((edge, microbatch))
        self._changes += 1
        if at is not None:
            self.arrival_times[(edge, microbatch)] = at

    def record_launch(self, action: _Action) -> None:
        """``action`` (returned by ``choose``) has been launched.

        Its local successors may be launched right behind it: the device runs a rank's
        actions in launch order. Messages it sends count only once they arrive.
        """
        node = self._node_of(action)
        if self._done[node.index] or self._block(node) is not None:
            raise RuntimeError(f"{action} launched out of turn on rank {self.rank}")
        self._done[node.index] = True
        self._changes += 1
        self._remaining -= 1
        for sid in node.streams:
            self._heads[sid] += 1
        if node.index != self.first_undone and node.kind != "R":
            self.out_of_order += 1
        if node.kind == "F" and node.index != self.first_undone:
            self._forwards_ahead += 1
        while self.first_undone < len(self.nodes) and self._done[self.first_undone]:
            self.first_undone += 1
            passed = self.nodes[self.first_undone - 1]
            if passed.kind == "F" and passed is not node:
                self._forwards_ahead -= 1
        self.realized.append(action)
        if node.kind in ("F", "BI"):
            self.last_kind = node.kind
        if node.kind == "F":
            s = node.stage
            self.in_flight[s] += 1
            self.held += 1
            self._forwards_left[s] -= 1
            self.peak_in_flight[s] = max(self.peak_in_flight[s], self.in_flight[s])
            self.peak_held = max(self.peak_held, self.held)
            if (self.limits is not None and self._forwards_left[s] > 0
                    and self.in_flight[s] == self.limits[s]):
                self.backpressure_entries[s] += 1
        if node.releases:
            self.in_flight[node.stage] -= 1
            self.held -= 1

    def _node_of(self, action: _Action) -> Node:
        try:
            return self.nodes[self._index_of[action]]
        except KeyError:
            raise KeyError(f"{action} is not in rank {self.rank}'s hint") from None


class OwnOrder:
    """The hint's own order: only its first action not yet run (policy ``"fixed"``)."""

    name = "fixed"

    def choose(self, ready: Sequence[Node], arbiter: ArbiterView) -> Node | None:
        return ready[0] if ready[0].index == arbiter.first_undone else None

    def lead(self, arbiter: ArbiterView) -> int:
        return arbiter.first_undone


def check_deadlock_free(hint: Hint) -> None:
    """Run every rank's arbiter in the hint's own order with instant compute and
    communication.

    Raises ``ValueError`` naming what each rank waits for if the hint cannot complete
    (e.g. a hand-written CSV whose ranks wait on each other).
    """
    arbiters = {r: Arbiter(hint, r, policy=OwnOrder()) for r in range(hint.num_ranks)}
    progress = True
    while progress:
        progress = False
        for arbiter in arbiters.values():
            while (action := arbiter.choose()) is not None:
                arbiter.record_launch(action)
                for edge in arbiter.plan.node(action).sends:
                    arbiters[hint.stage_to_rank[edge.dst]].deliver(edge, action.microbatch_index)
                progress = True
    stuck = {r: a.waits() for r, a in arbiters.items() if not a.finished}
    if stuck:
        detail = "; ".join(f"rank {r}: {', '.join(map(str, ws[:2]))}" for r, ws in stuck.items())
        raise ValueError(f"hint {hint.name!r} deadlocks when run in its own order: {detail}")
