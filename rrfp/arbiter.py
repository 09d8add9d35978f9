"""The ready-set arbiter: which action one pipeline rank runs next.

Pure Python and free of torch.distributed, so the runtime (``rrfp.schedule``) and the
simulator (``rrfp.sim``) drive this very class. It knows the rank's streams, what is done,
which messages have arrived and the backpressure state, and answers "what runs next?"
in O(streams).

Correctness rests on one rule: an action may run only at the head of each of its streams
(per stage: forwards; input-gradient backwards B/I; weight-gradient accumulations B/W).
So every channel carries messages in an order both ends know, and gradients accumulate
in the hint's order: RRFP's results are bitwise those of the fixed schedule. Only the
interleaving of streams is decided at run time, by a policy (``rrfp.policy``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from rrfp.hints import (
    _Action,
    Edge,
    F,
    Hint,
    I,
    INPUT_GRAD_KINDS,
    REDUCE_GRAD,
    W,
    WEIGHT_GRAD_KINDS,
)
from rrfp.settings import parse_buffer_limit

Kind = str  # "F", "BI" (B or I), "W", "R" (REDUCE_GRAD)


@dataclass(eq=False)
class Node:
    """One action of the rank's hint, with what it waits for."""

    index: int
    """Position in the rank's hint order (its rank: lower runs first when both ready)."""
    action: _Action
    kind: Kind
    streams: tuple[int, ...]
    message: tuple[Edge, int] | None
    """The remote message (edge, microbatch) it consumes, if any."""
    deps: tuple[int, ...]
    """Indices of this rank's actions that must be launched first."""
    stage: int
    microbatch: int | None


@dataclass(frozen=True)
class Wait:
    """Why a stream head cannot run yet."""

    action: _Action
    reason: str
    peer_stage: int | None = None
    peer_rank: int | None = None
    """Pipeline rank (index in the PP group) the message comes from."""

    def __str__(self) -> str:
        return f"{describe(self.action)} waits for {self.reason}"


def describe(action: _Action) -> str:
    """``stage 1 F microbatch 0``: how errors and logs name an action."""
    text = f"stage {action.stage_index} {action.computation_type.value}"
    if action.microbatch_index is not None:
        text += f" microbatch {action.microbatch_index}"
    return text


def _by_index(node: Node) -> int:
    return node.index


def _kind_of(action: _Action) -> Kind:
    ctype = action.computation_type
    if ctype == F:
        return "F"
    if ctype in INPUT_GRAD_KINDS:
        return "BI"
    if ctype == W:
        return "W"
    if ctype == REDUCE_GRAD:
        return "R"
    raise ValueError(f"the arbiter does not run {action}")


@dataclass(frozen=True)
class MemoryLimits:
    """Microbatches of activations a rank may hold (see ``resolve_buffer_limits``).

    A microbatch's activations on a stage are held from its F until its last backward
    piece: B, or W when backward is split.
    """

    per_stage: Mapping[int, int]
    """Per stage: microbatches held at once."""
    per_rank: Mapping[int, int]
    """Per pipeline rank: microbatches held at once by all its stages together."""

    def first_stage_below(self, peaks: Mapping[int, int]) -> tuple[int, int, int] | None:
        """The first stage whose limit is below ``peaks`` (a hint's own), as
        ``(stage, limit, peak)``; None if every stage's limit reaches its peak."""
        return next(((s, self.per_stage[s], peak) for s, peak in peaks.items()
                     if self.per_stage[s] < peak), None)


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
    """How a rank picks among ready actions (``rrfp.policy`` holds the policies)."""

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
    (``rrfp.policy.make_policy``).
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
        local = set(hint.stages_on(rank))
        self.limits = {s: limits.per_stage[s] for s in local} if limits is not None else None
        self.rank_limit = limits.per_rank[rank] if limits is not None else None
        peaks = hint.peak_in_flight()
        # Below the hint's own peak the fixed order itself would stall on backpressure,
        # so "the hint's next action is always allowed" no longer guarantees progress.
        self.below_hint_memory = self.limits is not None and any(
            self.limits[s] < peaks[s] for s in self.limits)
        self.policy = policy
        actions = hint.orders[rank]
        position = {(a.stage_index, a.computation_type, a.microbatch_index): i
                    for i, a in enumerate(actions)}

        def find(stage: int, kinds, mb: int | None) -> int:
            for kind in kinds:
                if (stage, kind, mb) in position:
                    return position[(stage, kind, mb)]
            raise ValueError(f"hint has no {'/'.join(k.value for k in kinds)} for stage {stage} mb {mb}")

        stream_ids: dict[tuple, int] = {}
        members: list[list[int]] = []

        def stream(key: tuple) -> int:
            if key not in stream_ids:
                stream_ids[key] = len(members)
                members.append([])
            return stream_ids[key]

        last_weight_grad: dict[int, int] = {}
        self.nodes: list[Node] = []
        for i, a in enumerate(actions):
            kind = _kind_of(a)
            s, m, ctype = a.stage_index, a.microbatch_index, a.computation_type
            streams: list[int] = []
            deps: list[int] = []
            message = None
            if kind == "F":
                streams.append(stream((s, "F")))
                if s > 0:
                    if s - 1 in local:
                        deps.append(find(s - 1, (F,), m))
                    else:
                        message = (Edge(s - 1, s), m)
            elif kind == "BI":
                streams.append(stream((s, "BI")))
                deps.append(find(s, (F,), m))
                if s < hint.num_stages - 1:
                    if s + 1 in local:
                        deps.append(find(s + 1, tuple(INPUT_GRAD_KINDS), m))
                    else:
                        message = (Edge(s + 1, s), m)
            elif kind == "W":
                deps.append(find(s, (I,), m))
            else:  # REDUCE_GRAD: after the stage's last weight-gradient action
                streams.append(stream(("R",)))
                if s in last_weight_grad:
                    deps.append(last_weight_grad[s])
            if ctype in WEIGHT_GRAD_KINDS:
                streams.append(stream((s, "GRAD")))
                last_weight_grad[s] = i
            for sid in streams:
                members[sid].append(i)
            self.nodes.append(Node(i, a, kind, tuple(streams), message, tuple(deps), s, m))

        self._streams = members
        self._stream_ids = stream_ids
        self._index_of = {n.action: n.index for n in self.nodes}
        self._heads = [0] * len(members)
        self._done = [False] * len(self.nodes)
        self._arrived: set[tuple[Edge, int]] = set()
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
        self._future_peak = hint.future_rank_peak(rank)
        self._forwards_ahead = 0
        """Forwards launched at hint positions after ``first_undone``."""
        self._forwards_left = {s: sum(1 for n in self.nodes if n.kind == "F" and n.stage == s)
                               for s in local}
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
        if reduce is not None and self._may_run(reduce):
            return reduce.index
        return self.policy.lead(self)

    def may_run(self, action: _Action) -> bool:
        """Whether ``action`` is ready to run now (head of its streams, inputs there)."""
        node = self._node_of(action)
        return not self._done[node.index] and self._may_run(node)

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
        """The first thing ``node`` waits for, or None if it may run now."""
        for sid in node.streams:
            head = self._streams[sid][self._heads[sid]]
            if head != node.index:
                return Wait(node.action, f"{describe(self.nodes[head].action)} to run first (stream order)")
        for dep in node.deps:
            if not self._done[dep]:
                return Wait(node.action, f"{describe(self.nodes[dep].action)} on this rank")
        if node.message is not None and node.message not in self._arrived:
            edge, _ = node.message
            what = "input activation" if edge.is_forward else "output gradient"
            peer = self.hint.stage_to_rank[edge.src]
            return Wait(node.action, f"its {what} from stage {edge.src} on pipeline rank {peer}",
                        peer_stage=edge.src, peer_rank=peer)
        if node.kind == "F" and self.limits is not None and not self._fits(node):
            limit = self.limits[node.stage]
            return Wait(node.action, f"a backward of stage {node.stage} or another of this "
                        f"rank's stages (backpressure: the stage holds "
                        f"{self.in_flight[node.stage]} microbatches, limit {limit}; the rank "
                        f"{self.held}, limit {self.rank_limit}; "
                        f"{self._forwards_ahead} forwards ahead of the hint)")
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

    def _may_run(self, node: Node) -> bool:
        """``_blocked_by(node) is None``, without building the explanation (hot path)."""
        streams, heads = self._streams, self._heads
        for sid in node.streams:
            if streams[sid][heads[sid]] != node.index:
                return False
        done = self._done
        for dep in node.deps:
            if not done[dep]:
                return False
        if node.message is not None and node.message not in self._arrived:
            return False
        if node.kind == "F" and self.limits is not None:
            return self._fits(node)
        return True

    def ready(self) -> list[Node]:
        """Actions that may run now, in hint order."""
        ready = [n for n in self.stream_heads() if self._may_run(n)]
        if len(ready) > 1:
            ready.sort(key=_by_index)
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
        chosen = next((n for n in ready if n.kind == "R"), None) or self.policy.choose(ready, self)
        return chosen.action if chosen is not None else None

    def deliver(self, edge: Edge, microbatch: int, at: float | None = None) -> None:
        """A message on ``edge`` for ``microbatch`` has arrived (``at``: when, if known)."""
        self._arrived.add((edge, microbatch))
        if at is not None:
            self.arrival_times[(edge, microbatch)] = at

    def record_launch(self, action: _Action) -> None:
        """``action`` (returned by ``choose``) has been launched.

        Its local successors may be launched right behind it: the device runs a rank's
        actions in launch order. Messages it sends count only once they arrive.
        """
        node = self._node_of(action)
        if self._done[node.index] or not self._may_run(node):
            raise RuntimeError(f"{action} launched out of turn on rank {self.rank}")
        self._done[node.index] = True
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
        elif node.action.computation_type in WEIGHT_GRAD_KINDS:  # the last backward piece
            self.in_flight[node.stage] -= 1
            self.held -= 1

    def messages_sent_by(self, action: _Action) -> list[Edge]:
        """Remote edges ``action`` sends a message on once it has run."""
        s, ctype = action.stage_index, action.computation_type
        if ctype == F:
            edge = Edge(s, s + 1)
        elif ctype in INPUT_GRAD_KINDS:
            edge = Edge(s, s - 1)
        else:
            return []
        in_range = 0 <= edge.dst < self.hint.num_stages
        if in_range and self.hint.stage_to_rank[edge.dst] != self.rank:
            return [edge]
        return []

    def _node_of(self, action: _Action) -> Node:
        try:
            return self.nodes[self._index_of[action]]
        except KeyError:
            raise KeyError(f"{action} is not in rank {self.rank}'s hint") from None


def resolve_buffer_limits(spec: str | int, hint: Hint, *,
                          fixed_order: bool = False) -> MemoryLimits:
    """Memory limits from ``"hint"``, ``"hint+k"``, ``"Nx hint"``, ``"busiest"``, a byte
    budget, ``"auto"`` or an int (any spelling
    ``rrfp.settings.parse_buffer_limit`` takes), in microbatches of activations held (from
    a microbatch's F until its last backward piece, B or W):

    * ``"hint"``: per stage, the fixed schedule's own peak; per rank, its per-rank peak (the
      most the rank's stages hold together at any moment of the fixed order). So RRFP never
      holds more, on any stage or rank, than the fixed schedule holds at some moment.
    * ``"hint+k"``: ``k`` more per stage and ``k`` more per rank; ``"Nx hint"``: N times
      the hint's peaks.
    * ``"busiest"``: per stage and per rank, what the fixed schedule's busiest rank holds
      at once (the largest per-rank peak). No rank then holds more than the fixed
      schedule's busiest rank, the one that sizes the job's memory, so the job's peak is
      unchanged; the other ranks' headroom becomes slack. Counted in microbatches here,
      which is exact where every stage's microbatch saves the same bytes (the
      simulator's model); ``ScheduleRRFP`` counts it in bytes from its second step
      (``first_step_limits``, ``limits_within_bytes``), as it does a byte budget or
      ``"auto"``, which are refused here with ``ValueError``: they need measured bytes.
    * an int ``n``: ``n`` per stage and ``n`` per rank.

    Deadlock-freedom. (1) At limits no lower than the hint's own peaks, the hint's next
    action (``first_undone``) always fits. Per stage: streams run in hint order, so when
    that action is a forward of stage s no later forward of s has been launched, and the
    stage holds at most what the fixed order holds at that point, below its peak. Per rank:
    the arbiter lets a forward run ahead of the hint's next action only while the forwards
    run ahead (A) stay within ``rank limit - M``, where M is the most the fixed order holds
    from the next action on. The rank holds at most ``h + A`` (h: what the fixed order
    holds at that point; backward pieces run ahead only lower it), so the next forward
    brings it to ``h + 1 + A <= M + (limit - M)``; and the invariant survives every launch
    (A grows only under the rule, and when the next action moves on, A can only shrink
    while M can only fall). The fixed order itself completes (``check_deadlock_free``), so
    the earliest action of its dependency order not yet launched is always launchable:
    RRFP always progresses, whatever the timing, under any policy that, on an idle device,
    runs some ready action whenever the hint's next one is ready (every policy here does:
    lookahead, window and fixed accept the hint's next action; the others are greedy).
    (2) Below the hint's peak on a stage that is alone on its rank, when every
    stage's F and B/I streams follow one common microbatch order: the earliest microbatch in
    flight can always move, since every forward it still needs is the hint's next action on
    its rank and its stage holds nothing older. Limits below the hint's peak elsewhere (a
    rank holding several stages, or streams in different orders as in LoopedBFS) are
    refused with ``ValueError``. ``tests/test_arbiter.py`` checks this in the simulator for
    thousands of random timings, every hint, every policy and a range of limits.
    """
    limit = parse_buffer_limit(spec)
    if limit.auto or limit.budget_bytes is not None:
        raise ValueError(
            f"buffer_limit={spec!r} is a byte budget, which becomes microbatch limits only "
            "from the bytes per microbatch a first step measures (ScheduleRRFP does this; "
            "see first_step_limits); counted in microbatches, as in the simulator, use "
            "'busiest', 'hint+k' or an int")
    rank_peaks = hint.rank_peaks()
    busiest = max(rank_peaks.values())
    limits = MemoryLimits(
        {s: limit.of(peak, busiest) for s, peak in hint.peak_in_flight().items()},
        {r: limit.of(peak, busiest) for r, peak in rank_peaks.items()})
    check_limits(limits, hint, spec, fixed_order=fixed_order)
    return limits


def first_step_limits(spec: str | int, hint: Hint, *, fixed_order: bool = False) -> MemoryLimits:
    """The limits of ``ScheduleRRFP``'s first training step: ``resolve_buffer_limits``' for
    a microbatch setting; the hint's own peaks for one in bytes (``"busiest"``, a budget,
    ``"auto"``), whose microbatch limits follow from that step's measured bytes
    (``limits_within_bytes``)."""
    in_bytes = parse_buffer_limit(spec).in_bytes
    return resolve_buffer_limits("hint" if in_bytes else spec, hint, fixed_order=fixed_order)


def check_limits(limits: MemoryLimits, hint: Hint, spec: object, *,
                 fixed_order: bool = False) -> None:
    """``ValueError`` unless ``limits`` are deadlock-free for ``hint`` (see
    ``resolve_buffer_limits``); ``spec``: how the user wrote them, for the message.
    ``fixed_order``: the hint's order runs as it is (``policy="fixed"``), which needs every
    stage's own peak."""
    peaks, rank_peaks = hint.peak_in_flight(), hint.rank_peaks()
    below = limits.first_stage_below(peaks)
    if fixed_order and below is not None:
        s, got, need = below
        raise ValueError(
            f"policy='fixed' runs hint {hint.name!r} in its own order, which holds up to "
            f"{need} microbatches on stage {s}, but buffer_limit={spec!r} allows {got}: it "
            "would stall; use buffer_limit='hint' (or larger) with policy='fixed'")
    for rank, peak in rank_peaks.items():
        stages = hint.stages_on(rank)
        if len(stages) > 1 and limits.per_rank[rank] < peak:
            raise ValueError(
                f"buffer_limit={spec!r} allows {limits.per_rank[rank]} microbatches of "
                f"activations on pipeline rank {rank}, which holds stages {list(stages)}: "
                f"below the {peak} that hint {hint.name!r} itself holds there at once, which "
                "a rank with several stages needs to be deadlock-free; use 'hint', 'hint+k' "
                f"or an int >= {max(rank_peaks.values())}")
    if not hint.streams_share_one_order():
        if below is not None:
            s, got, need = below
            raise ValueError(
                f"buffer_limit={spec!r} allows {got} microbatches in flight on stage {s}, "
                f"but hint {hint.name!r} runs its backwards in a different microbatch order "
                f"than its forwards, which needs its own peak ({need}) to be deadlock-free: "
                "use 'hint', 'hint+k' or a larger int"
            )


def fixed_peak_bytes(hint: Hint, bytes_per_microbatch: Mapping[int, int]) -> dict[int, int]:
    """Per rank, the most activation bytes the hint's fixed order holds at once, where a
    microbatch held on stage s holds ``bytes_per_microbatch[s]`` (held from its F until
    its last backward piece, as ``Hint.peak_in_flight`` counts)."""
    peaks = {}
    for rank, actions in hint.orders.items():
        total = peak = 0
        for action in actions:
            nbytes = bytes_per_microbatch[action.stage_index]
            if action.computation_type == F:
                total += nbytes
                peak = max(peak, total)
            elif action.computation_type in WEIGHT_GRAD_KINDS:  # the last backward piece
                total -= nbytes
        peaks[rank] = peak
    return peaks


@dataclass(frozen=True)
class ByteLimits:
    """Microbatch limits derived from byte budgets (``limits_within_bytes``)."""

    limits: MemoryLimits
    budgets: Mapping[int, int]
    """Per rank: the activation bytes it may hold."""
    allowed_bytes: Mapping[int, int]
    """Per rank: the most bytes ``limits`` let its stages hold at once (the worst mix of
    microbatches the per-stage and per-rank limits allow). Within ``budgets`` except where
    the hint's own peaks already exceed them (the floor, kept for deadlock-freedom)."""
    fixed_peak_bytes: Mapping[int, int]
    """Per rank: the bytes the hint's fixed order holds at its peak."""

    def over_budget(self) -> list[int]:
        """Ranks where even the hint's own peaks may exceed the budget."""
        return [r for r, allowed in self.allowed_bytes.items() if allowed > self.budgets[r]]


def limits_within_bytes(hint: Hint, bytes_per_microbatch: Mapping[int, int],
                        budgets: Mapping[int, int]) -> ByteLimits:
    """The largest microbatch limits under which no rank can hold more than its byte
    budget, given each stage's bytes per microbatch; never below the hint's own peaks (per
    stage and per rank), which keep every step deadlock-free (``resolve_buffer_limits``).

    A rank's bytes are bounded by its worst mix: its per-rank limit filled with the
    microbatches of its largest stages first, each stage up to its own limit. From the
    hint's peaks, the rank limit and every stage's limit grow together one microbatch at a
    time while that bound fits the budget ("hint+k" in bytes); then single stages grow,
    smallest bytes first, while it still fits (with the rank limit binding, a stage's
    limit costs nothing more). Limits stop at the step's microbatches (a stage never holds
    more). ``ValueError`` where a budget is below what the fixed order itself holds there:
    no limit can keep that rank within it.
    """
    stage_peaks, rank_peaks = hint.peak_in_flight(), hint.rank_peaks()
    fixed = fixed_peak_bytes(hint, bytes_per_microbatch)
    per_stage: dict[int, int] = {}
    per_rank: dict[int, int] = {}
    allowed: dict[int, int] = {}
    cap = hint.n_microbatches
    for rank in hint.orders:
        stages = hint.stages_on(rank)
        budget = budgets[rank]
        if fixed[rank] > budget:
            raise ValueError(
                f"pipeline rank {rank}'s activation budget is {budget} B, but hint "
                f"{hint.name!r} itself holds {fixed[rank]} B of activations there at its peak "
                f"(bytes per microbatch per stage, measured in the first step: "
                f"{ {s: bytes_per_microbatch[s] for s in stages} }): give at least "
                f"{fixed[rank]} B on that rank, or use buffer_limit='hint'")
        limit = {s: stage_peaks[s] for s in stages}
        rank_limit = rank_peaks[rank]

        def worst(limit: Mapping[int, int], rank_limit: int) -> int:
            room, total = rank_limit, 0
            for s in sorted(stages, key=lambda s: -bytes_per_microbatch[s]):
                take = min(limit[s], room)
                total, room = total + take * bytes_per_microbatch[s], room - take
            return total

        while rank_limit < cap * len(stages):
            wider = {s: min(limit[s] + 1, cap) for s in stages}
            if worst(wider, rank_limit + 1) > budget:
                break
            limit, rank_limit = wider, rank_limit + 1
        for s in sorted(stages, key=lambda s: bytes_per_microbatch[s]):
            while limit[s] < min(cap, rank_limit) and worst({**limit, s: limit[s] + 1},
                                                             rank_limit) <= budget:
                limit[s] += 1
        per_stage.update(limit)
        per_rank[rank] = rank_limit
        allowed[rank] = worst(limit, rank_limit)
    return ByteLimits(MemoryLimits(per_stage, per_rank), dict(budgets), allowed, fixed)


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
                for edge in arbiter.messages_sent_by(action):
                    arbiters[hint.stage_to_rank[edge.dst]].deliver(edge, action.microbatch_index)
                progress = True
    stuck = {r: a.waits() for r, a in arbiters.items() if not a.finished}
    if stuck:
        detail = "; ".join(f"rank {r}: {', '.join(map(str, ws[:2]))}" for r, ws in stuck.items())
        raise ValueError(f"hint {hint.name!r} deadlocks when run in its own order: {detail}")
