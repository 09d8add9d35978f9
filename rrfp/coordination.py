"""Agreement inside an intra-stage collective group (tensor parallel, and later EP/CP).

Every rank of such a group must run the same action sequence: the stage's compute issues
collectives on the group, and they only match if all ranks run the same action. Under
RRFP each rank would pick from its own ready set, which timing makes differ, so before
each action the group settles on one. Both mechanisms talk over a CPU (gloo) group, so no
device synchronization is involved:

* ``AgreeOnProposals`` (the paper's): each rank proposes the action it picked (or none);
  the group all-gathers the proposals; if they all name the same action it runs,
  otherwise every rank defers, waits briefly for new arrivals and proposes the hint's next
  action until one is agreed (ranks whose policies rank alike actions differently, e.g. by
  their own arrival times or measured durations, would otherwise disagree for good).
* ``LeaderDecides``: the group's first rank picks and broadcasts its choice; the others
  run that action as soon as it is ready for them.

Both keep the hint's next action always acceptable (the fixed order is a common fallback),
so they add no deadlock the fixed schedule does not have. Every collective is waited for at
most ``stall_timeout`` seconds: a peer that stopped or failed makes the others raise
``PipelineStallError`` naming it, instead of waiting for gloo's own timeout.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rrfp.arbiter import Arbiter
from rrfp.hints import _Action
from rrfp.loop import PipelineStallError

COORDINATIONS = ("leader", "agree")
_NONE = -1


class Coordinator(Protocol):
    needs_choice: bool
    """Whether this rank's own choice matters (a follower only runs the leader's)."""
    waits_when_idle: bool
    """Whether the caller may block for arrivals when ``settle`` returns None (the
    proposal rounds must keep going instead)."""
    rounds: int
    """Collective calls made (all-gathers or broadcasts)."""
    deferrals: int
    """Rounds that ended without agreement (AgreeOnProposals only)."""
    seconds: float
    """Time spent in the coordination collectives and waits they caused."""

    def settle(self, choice: _Action | None, arbiter: Arbiter,
               wait_for_arrivals: Callable[[float], None]) -> _Action | None:
        """The action the whole group runs now, or None (this rank waits/retries)."""
        ...

    def finish(self) -> None:
        """Complete any outstanding communication of the step."""
        ...


def _wait(work: dist.Work, stall_timeout: float, what: str) -> None:
    try:
        work.wait(datetime.timedelta(seconds=stall_timeout))
    except RuntimeError as e:
        raise PipelineStallError(f"{what} did not complete within stall_timeout "
                                 f"({stall_timeout:g} s): {e}") from e


class AgreeOnProposals:
    """The paper's coordination: all-gather the proposals; run only on agreement."""

    name = "agree"
    needs_choice = True
    waits_when_idle = False

    def __init__(self, group: dist.ProcessGroup, stall_timeout: float,
                 retry_interval: float = 0.002):
        self.group = group
        self.stall_timeout = stall_timeout
        self.size = dist.get_world_size(group)
        self.retry_interval = retry_interval
        self.rounds = self.deferrals = 0
        self.seconds = 0.0
        self._mine = torch.zeros(1, dtype=torch.int64)
        self._all = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._fall_back = False
        """After a disagreement every rank proposes the hint's next action (the same on all:
        they ran the same sequence), which becomes ready on all of them."""

    def settle(self, choice, arbiter, wait_for_arrivals):
        start = time.perf_counter()
        if self._fall_back:
            head = arbiter.nodes[arbiter.first_undone].action
            choice = head if arbiter.may_run(head) else None
        self._mine.fill_(_NONE if choice is None else arbiter.position(choice))
        work = dist.all_gather(self._all, self._mine, group=self.group, async_op=True)
        peers = [r for r in dist.get_process_group_ranks(self.group) if r != dist.get_rank()]
        _wait(work, self.stall_timeout, "all-gathering the proposals of this rank's "
              f"coordination group with global rank {', '.join(map(str, peers))}")
        self.rounds += 1
        proposals = {int(t) for t in self._all}
        if len(proposals) == 1 and _NONE not in proposals:
            self.seconds += time.perf_counter() - start
            self._fall_back = False
            return choice
        if proposals != {_NONE}:
            self.deferrals += 1
            self._fall_back = True
        # Disagreement (or nothing anywhere): wait for something to change, then retry.
        wait_for_arrivals(self.retry_interval)
        self.seconds += time.perf_counter() - start
        return None

    def finish(self) -> None:
        pass


class LeaderDecides:
    """The group's first rank picks; the others follow its sequence."""

    name = "leader"
    waits_when_idle = True

    def __init__(self, group: dist.ProcessGroup, stall_timeout: float):
        self.group = group
        self.stall_timeout = stall_timeout
        self.leader = dist.get_global_rank(group, 0)
        self.is_leader = self.needs_choice = dist.get_rank() == self.leader
        self.rounds = self.deferrals = 0
        self.seconds = 0.0
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._decided: _Action | None = None

    def settle(self, choice, arbiter, wait_for_arrivals):
        start = time.perf_counter()
        if self.is_leader:
            if choice is not None:
                decision = torch.tensor([arbiter.position(choice)], dtype=torch.int64)
                work = dist.broadcast(decision, src=self.leader, group=self.group, async_op=True)
                self._pending.append((work, decision))
                self.rounds += 1
            self.seconds += time.perf_counter() - start
            return choice
        if self._decided is None:
            decision = torch.zeros(1, dtype=torch.int64)
            work = dist.broadcast(decision, src=self.leader, group=self.group, async_op=True)
            _wait(work, self.stall_timeout,
                  f"the decision of coordination leader global rank {self.leader}")
            self.rounds += 1
            self._decided = arbiter.nodes[int(decision)].action
        self.seconds += time.perf_counter() - start
        if not arbiter.may_run(self._decided):
            return None  # the caller waits for arrivals and asks again
        decided, self._decided = self._decided, None
        return decided

    def finish(self) -> None:
        for work, _ in self._pending:
            _wait(work, self.stall_timeout, "broadcasting this leader's decisions to "
                  f"global ranks {dist.get_process_group_ranks(self.group)}")
        self._pending.clear()


def uncovered_sharded_parameter(named_parameters: Iterable[tuple[str, torch.Tensor]],
                                covered: set[int]) -> tuple[str, list[int]] | None:
    """The first parameter sharded over ranks that ``covered`` does not include, with
    those ranks (its mesh's), or None.

    Call with FSDP modules unsharded: a parameter that is then still a DTensor on a mesh of
    several ranks is sharded over a group whose collectives run inside the stage's
    compute: tensor parallel (a TP mesh), expert parallel (the EP mesh of the experts'
    weights, whose tokens travel by all-to-all), or both (an EP x TP mesh).
    """
    for name, p in named_parameters:
        if not isinstance(p, DTensor) or p.device_mesh.size() == 1:
            continue
        ranks = sorted(set(p.device_mesh.mesh.flatten().tolist()))
        if not set(ranks) <= covered:
            return name, ranks
    return None


def make_coordinator(kind: str, group: dist.ProcessGroup, stall_timeout: float) -> Coordinator:
    if kind == "leader":
        return LeaderDecides(group, stall_timeout)
    if kind == "agree":
        return AgreeOnProposals(group, stall_timeout)
    raise ValueError(f"unknown coordination {kind!r}: use one of {list(COORDINATIONS)}")
