"""Agreement inside an intra-stage collective group (tensor or expert parallel).

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
  run that action as soon as it is ready for them. Followers post the receive of the
  next decision ahead, so they wait only when the leader has not decided yet.

Both talk over a private twin of the user's coordination group (``CoordinationGroup``),
built from the store by its members alone: a leader's decisions go out ahead of the
stage's own collectives, and a follower posts the receive of the next decision ahead, so
sharing the group the stage's compute uses (the TP group itself, on CPU) would pair a
decision with a tensor-parallel all-reduce.

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
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.distributed.tensor import DTensor

from rrfp.comm.board import FailureBoard
from rrfp.comm.channels import make_channel_group
from rrfp.comm.store_keys import generation_store
from rrfp.core.actions import _Action
from rrfp.core.arbiter import Arbiter
from rrfp.core.errors import PipelineStallError
from rrfp.core.settings import COORDINATIONS

_NONE = -1


class CoordinationGroup:
    """A private gloo twin of a coordination group: the same ranks, a communicator of its
    own, created by its members alone under ``rrfp/coordination/<ranks>/<generation>``
    in the default store (every member builds as many schedules over the group as the
    others, so the generations match)."""

    def __init__(self, group: dist.ProcessGroup, timeout: float):
        self.global_ranks = tuple(dist.get_process_group_ranks(group))
        self.rank = self.global_ranks.index(dist.get_rank())
        name, store = generation_store("coordination", self.global_ranks)
        self.group = make_channel_group("gloo", store, self.rank,
                                        datetime.timedelta(seconds=timeout), group_name=name,
                                        global_ranks=self.global_ranks,
                                        size=len(self.global_ranks))

    @property
    def size(self) -> int:
        return len(self.global_ranks)

    def peers(self) -> list[int]:
        return [r for r in self.global_ranks if r != dist.get_rank()]

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """From the group's first rank (asynchronous)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self.group.broadcast([tensor], options)

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> dist.Work:
        """Asynchronous."""
        return self.group.allgather([outputs], [tensor])


class Coordinator(Protocol):
    name: str
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


def _private(group: CoordinationGroup | dist.ProcessGroup, timeout: float) -> CoordinationGroup:
    """``group`` itself if private already, else a new private twin of it."""
    return group if isinstance(group, CoordinationGroup) else CoordinationGroup(group, timeout)


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

    def __init__(self, group: CoordinationGroup | dist.ProcessGroup, stall_timeout: float,
                 retry_interval: float = 0.002):
        self.group = _private(group, stall_timeout)
        self.stall_timeout = stall_timeout
        self.size = self.group.size
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
        work = self.group.all_gather(self._all, self._mine)
        _wait(work, self.stall_timeout, "all-gathering the proposals of this rank's "
              f"coordination group with global rank {', '.join(map(str, self.group.peers()))}")
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
    """The group's first rank picks; the others follow its sequence.

    The leader broadcasts each decision as it makes it and goes on without waiting. A
    follower posts the receive of the next decision as soon as it has taken the current
    one, so the leader's next decision arrives while the follower runs the current
    action: it waits only when the leader has not decided yet.
    """

    name = "leader"
    waits_when_idle = True

    def __init__(self, group: CoordinationGroup | dist.ProcessGroup, stall_timeout: float):
        self.group = _private(group, stall_timeout)
        self.stall_timeout = stall_timeout
        self.leader = self.group.global_ranks[0]
        self.is_leader = self.needs_choice = self.group.rank == 0
        self.rounds = self.deferrals = 0
        self.seconds = 0.0
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        """Leader: its broadcasts not yet known to be complete."""
        self._next: tuple[dist.Work, torch.Tensor] | None = None
        """Follower: the receive of the leader's next decision, posted ahead."""
        self._taken = 0
        """Follower: decisions taken so far in the step."""
        self._decided: _Action | None = None

    def _post_next(self) -> None:
        decision = torch.zeros(1, dtype=torch.int64)
        self._next = (self.group.broadcast(decision), decision)
        self.rounds += 1

    def settle(self, choice, arbiter, wait_for_arrivals):
        start = time.perf_counter()
        if self.is_leader:
            if choice is not None:
                decision = torch.tensor([arbiter.position(choice)], dtype=torch.int64)
                self._pending.append((self.group.broadcast(decision), decision))
                self.rounds += 1
            self.seconds += time.perf_counter() - start
            return choice
        if self._decided is None:
            if self._next is None:
                self._post_next()
            work, decision = self._next
            _wait(work, self.stall_timeout,
                  f"the decision of coordination leader global rank {self.leader}")
            self._next = None
            self._decided = arbiter.nodes[int(decision)].action
            self._taken += 1
            # The leader broadcasts one decision per action of the step, no more.
            if self._taken < len(arbiter.nodes):
                self._post_next()
        self.seconds += time.perf_counter() - start
        if not arbiter.may_run(self._decided):
            return None  # the caller waits for arrivals and asks again
        decided, self._decided = self._decided, None
        return decided

    def finish(self) -> None:
        for work, _ in self._pending:
            _wait(work, self.stall_timeout, "broadcasting this leader's decisions to "
                  f"global ranks {self.group.peers()}")
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


def refuse_uncovered_sharding(stages: Iterable[_PipelineStageBase],
                              coordination_group: dist.ProcessGroup | None,
                              board: FailureBoard, timeout: float) -> None:
    """Refuse parameters sharded over a group that no coordination group covers, on
    every rank of the pipeline.

    Called at the first step with FSDP modules unsharded and before torch's shape
    inference, whose forward would run the stages' first intra-stage collectives (an
    expert-parallel all-to-all). A parameter still a DTensor there is sharded over a group
    whose collectives run inside the stage's compute (tensor or expert parallel); its
    ranks must run the same action sequence, which only a ``coordination_group`` over
    them ensures; without one they would interleave actions differently and issue
    mismatched collectives (a hang, or gloo's "collective mismatch" abort). The verdicts
    are exchanged over the pipeline's ``board``, so a rank whose own stages shard nothing
    (a dense stage next to MoE ones) refuses too, rather than waiting in shape inference
    for a peer that stopped.
    """
    covered = set(dist.get_process_group_ranks(coordination_group)
                  if coordination_group is not None else [dist.get_rank()])
    uncovered = uncovered_sharded_parameter(
        ((f"stage {stage.stage_index}'s {name!r}", p) for stage in stages
         for name, p in stage.submod.named_parameters()), covered)
    verdict = "" if uncovered is None else (
        f"parameter {uncovered[0]} is a DTensor sharded over global ranks "
        f"{uncovered[1]} (tensor or expert parallel), whose collectives run inside the "
        "stage's compute, but "
        + ("no coordination_group is given" if coordination_group is None
           else f"the coordination_group covers only {sorted(covered)}")
        + ": pass coordination_group=dist.new_group(<those ranks>, backend='gloo') "
        "(one group spanning every such mesh of the stages) so that they run the "
        "same actions")
    verdicts = board.gather("intra-stage-collectives", verdict, timeout)
    if verdict:
        raise ValueError(verdict)
    me = dist.get_rank()
    refusing = sorted(rank for rank, said in verdicts.items() if said and rank != me)
    if refusing:
        raise ValueError(f"global rank {refusing[0]} of this pipeline refuses its stages, "
                         f"so this rank cannot run either: {verdicts[refusing[0]]}")


def make_coordinator(kind: str, group: CoordinationGroup | dist.ProcessGroup,
                     stall_timeout: float) -> Coordinator:
    """A coordinator of ``kind`` over ``group`` (a ``dist.ProcessGroup`` gets a private
    twin, which its members must all create, in the same order)."""
    if kind == "leader":
        return LeaderDecides(group, stall_timeout)
    if kind == "agree":
        return AgreeOnProposals(group, stall_timeout)
    raise ValueError(f"unknown coordination {kind!r}: use one of {list(COORDINATIONS)}")
