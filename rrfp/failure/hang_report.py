"""One report for a stalled job, instead of a stall error per rank to read side by side.

When a rank's step stalls (``PipelineStallError``) it publishes the failure on the job's
board (``rrfp.comm.board``); every rank that then stops its step, or whose watch learns of
the failure between steps, tells its state through the store (``rank_state``: what it has
launched and completed, what is ready, what each stream head waits for and from whom,
and per channel the messages sent, and the receives posted whose message has not
arrived). The rank whose failure the board kept is the one to see the stall first: it
collects the states for at most ``HANG_REPORT_WAIT_S`` (a rank that said nothing by then
is named as silent), writes one report file, ``rrfp-hang-report-<job>.txt`` in the run
folder, and logs its head; the others' errors point at that file.

The report's first line names the rank, and the channel, that hold the others
(``find_holder``): follow each rank's wait for a message to the rank that should send
it, until one has run the action that produces the message but never sent it, or sent
it and the message never arrived, or said nothing; the holder most waiting ranks lead
to is named.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from rrfp.comm.board import FailureBoard
from rrfp.comm.transport import Transport
from rrfp.core.actions import describe, Edge
from rrfp.core.loop import StepLoop

logger = logging.getLogger(__name__)

HANG_REPORT_WAIT_S = 3.0
"""The longest the reporting rank waits for the others' states (at most ``stall_timeout``)."""
LOG_LINES = 12
"""Lines of the report in the reporting rank's log block."""

State = Mapping
"""A rank's state as told (``rank_state``): JSON-able."""


def channel_name(edge: Edge) -> str:
    return f"{edge.src}->{edge.dst}"


def rank_state(*, rank: int, pipeline_rank: int, stages: list[int], step: int,
               error: BaseException | None, loop: StepLoop | None,
               transport: Transport) -> dict:
    """What this rank tells a hang report: ``loop`` is the step it was in (None: not in a
    step)."""
    state: dict = {"rank": rank, "pipeline_rank": pipeline_rank, "stages": stages,
                   "step": step, "host": socket.gethostname(), "pid": os.getpid(),
                   "in_step": loop is not None,
                   "error": f"{type(error).__name__}: {error}".splitlines()[0] if error else ""}
    if loop is None:
        return state
    arbiter = loop.arbiter
    plan = arbiter.hint.plan
    global_ranks = transport.channels.global_ranks
    completed = [c.action for c in loop.completions]
    state.update({
        "launched": len(arbiter.realized), "actions": len(arbiter.nodes),
        "last_launched": describe(arbiter.realized[-1]) if arbiter.realized else None,
        "last_completed": describe(completed[-1]) if completed else None,
        "completed": [describe(a) for a in completed],
        "on_device": [describe(a) for a in loop.on_device],
        "ready": list(dict.fromkeys(describe(node.action) for node in arbiter.ready())),
        "waits": [{"action": describe(w.action), "reason": w.reason,
                   "peer": global_ranks[w.peer_rank] if w.peer_rank is not None else None,
                   "channel": channel_name(w.message[0]) if w.message else None,
                   "microbatch": w.message[1] if w.message else None,
                   "producer": describe(plan.sender(*w.message)) if w.message else None}
                  for w in dict.fromkeys(arbiter.waits())],  # a head of two streams: once
        "channels": {channel_name(edge): {
            "peer": channel.src_rank if channel.rank == 1 else channel.dst_rank,
            "receives": channel.rank == 1,
            "sent": list(ledger.sent), "arrived": list(ledger.arrived),
            "outstanding": ledger.outstanding,
            # Who sends each of its messages, from the plan: the report names the action.
            "producers": ([[mb, describe(plan.sender(edge, mb))]
                           for mb in plan.message_order(edge)] if channel.rank == 1 else [])}
            for edge, channel in transport.channels.items()
            if (ledger := transport.ledger.get(edge)) is not None},
    })
    return state


SILENT, UNSENT, STUCK, CYCLE, IDLE = range(5)
"""Kinds of holder, the likeliest cause first: a rank that said nothing (dead, or blocked
outside RRFP), a message produced and never sent or never arrived, an action its device
never completed, a cycle of waits, a rank waiting for nothing from a peer."""


@dataclass(frozen=True)
class Holder:
    """The rank (and channel) that holds the others, and why."""

    rank: int
    channel: str | None
    why: str
    kind: int = IDLE

    def line(self) -> str:
        on = f" on channel {self.channel}" if self.channel else ""
        return f"rrfp hang report: global rank {self.rank}{on} holds the others: {self.why}"


def _completed(state: State, action: str | None) -> bool:
    return action is not None and action in state.get("completed", ())


def _direct(states: Mapping[int, State], rank: int, wait: Mapping) -> Holder | None:
    """The producer of the message ``rank`` waits for, if it alone explains the wait."""
    producer, channel, mb = wait["peer"], wait["channel"], wait["microbatch"]
    waiting = f"global rank {rank} waits for it ({wait['action']})"
    theirs = states.get(producer)
    if theirs is None:
        return Holder(producer, channel, f"it said nothing (silent: dead, or blocked outside "
                      f"RRFP) while {waiting.replace('for it', f'for microbatch {mb} from it')}",
                      SILENT)
    sent = list(theirs.get("channels", {}).get(channel, {}).get("sent", ()))
    mine = states[rank].get("channels", {}).get(channel, {})
    expected = list(mine.get("arrived", ())) + list(mine.get("outstanding", ()))
    # Messages on a channel match in order: a message skipped makes the consumer take
    # each later one for the one it expected, and wait for one more at the end.
    skipped = next((m for i, m in enumerate(expected)
                    if m not in sent and any(later in sent for later in expected[i + 1:])), None)
    if skipped is not None:
        producers = {mb: action for mb, action in mine.get("producers", ())}
        ran = producers.get(skipped) if _completed(theirs, producers.get(skipped)) else None
        return Holder(producer, channel, (f"it ran {ran} but " if ran else "it ")
                      + f"never sent microbatch {skipped} (it sent {sent}); messages on a "
                      f"channel match in order, so global rank {rank} took the later ones "
                      f"for those it expected and waits for microbatch {mb} "
                      f"({wait['action']})", UNSENT)
    if mb in sent:
        return Holder(producer, channel, f"it sent microbatch {mb}, which never arrived; "
                      + waiting, UNSENT)
    action = wait.get("producer")
    if _completed(theirs, action):
        return Holder(producer, channel, f"it ran {action} but never sent its message; "
                      + waiting, UNSENT)
    if action is not None and action in theirs.get("on_device", ()):
        return Holder(producer, channel, f"its device never completed {action} (blocked "
                      f"inside the action's compute, e.g. in a collective); " + waiting, STUCK)
    return None


def _follow(states: Mapping[int, State], start: int) -> Holder:
    """Follow ``start``'s waits for messages to the rank that holds it."""
    rank, path = start, []
    while True:
        state = states[rank]
        waits = [w for w in state.get("waits", ()) if w.get("channel")]
        if not waits:
            if state.get("on_device"):
                return Holder(rank, None, f"its device never completed "
                              f"{state['on_device'][0]}", STUCK)
            if not state.get("in_step"):
                return Holder(rank, None, "it was not in a step (blocked outside RRFP?)")
            return Holder(rank, None, "it waits for no message: " + ("; ".join(
                f"{w['action']} waits for {w['reason']}" for w in state.get("waits", ()))
                or "it waits for nothing"))
        holders = [h for w in waits if (h := _direct(states, rank, w)) is not None]
        if holders:
            return min(holders, key=lambda h: h.kind)
        path.append(rank)
        following = waits[0]["peer"]
        if following in path:
            cycle = path[path.index(following):] + [following]
            return Holder(rank, waits[0]["channel"], "a cycle of waits for messages none of "
                          f"them produced: global ranks {' -> '.join(map(str, cycle))}", CYCLE)
        rank = following


def find_holder(states: Mapping[int, State], ranks: list[int]) -> tuple[Holder, list[int]]:
    """The likeliest holder the ranks' waits lead to (by kind, then by how many ranks
    lead there), and those ranks (see the module docstring)."""
    led: dict[Holder, list[int]] = {}
    for rank in sorted(states):
        if any(w.get("channel") for w in states[rank].get("waits", ())):
            led.setdefault(_follow(states, rank), []).append(rank)
    if led:
        holder = min(led, key=lambda h: (h.kind, -len(led[h]), h.rank))
        return holder, led[holder]
    silent = [rank for rank in ranks if rank not in states]
    if silent:
        return Holder(silent[0], None, "it said nothing (silent), and no rank that did "
                      "waits for a message", SILENT), []
    if states:
        return _follow(states, min(states)), []
    return Holder(-1, None, "no rank told its state"), []


def _describe_rank(state: State) -> list[str]:
    head = (f"global rank {state['rank']} (pipeline rank {state['pipeline_rank']}, stages "
            f"{state['stages']}, {state['host']} pid {state['pid']})")
    if not state.get("in_step"):
        return [f"{head}: not in a step. {state.get('error', '')}".rstrip()]
    lines = [f"{head}: step {state['step']}, launched {state['launched']} of "
             f"{state['actions']} actions; last launched {state['last_launched']}, last "
             f"completed {state['last_completed']}",
             f"  raised: {state['error']}",
             f"  launched, not completed: {', '.join(state['on_device']) or 'none'}",
             f"  ready: {', '.join(state['ready']) or 'none'}"]
    for wait in state["waits"]:
        peer = f" (global rank {wait['peer']})" if wait["peer"] is not None else ""
        lines.append(f"  {wait['action']} waits for {wait['reason']}{peer}")
    for name, channel in sorted(state["channels"].items()):
        if channel["receives"]:
            lines.append(f"  channel {name} from global rank {channel['peer']}: arrived "
                         f"{channel['arrived']}, posted and not arrived {channel['outstanding']}")
        else:
            lines.append(f"  channel {name} to global rank {channel['peer']}: sent "
                         f"{channel['sent']}")
    return lines


def report_text(states: Mapping[int, State], ranks: list[int], reporter: int,
                job: str) -> str:
    """The report: the holder first, then who reported, then each rank's state."""
    holder, led = find_holder(states, ranks)
    silent = [rank for rank in ranks if rank not in states]
    lines = [holder.line(),
             f"written by global rank {reporter} at "
             f"{datetime.datetime.now().isoformat(timespec='seconds')} for {job}; "
             f"{len(states)} of {len(ranks)} ranks told their state; silent (said nothing "
             f"within the report's wait): {silent or 'none'}",
             f"ranks whose waits lead to global rank {holder.rank}: {led or 'none'}", ""]
    for rank in sorted(states):
        lines.extend(_describe_rank(states[rank]))
    return "\n".join(lines) + "\n"


class HangReport:
    """The job's hang report: where it goes, and telling and collecting the states."""

    def __init__(self, board: FailureBoard, job: str, folder: str | None, wait_s: float):
        self._board, self.job, self.folder, self.wait_s = board, job, folder, wait_s

    @property
    def path(self) -> str:
        """The report file: in ``folder`` (None: the current working directory)."""
        return os.path.abspath(os.path.join(self.folder or os.getcwd(),
                                            f"rrfp-hang-report-{self.job}.txt"))

    def tell(self, state: dict) -> None:
        """Tell this rank's state to whichever rank writes the report."""
        try:
            self._board.tell("state", json.dumps(state), job=True)
        except Exception as e:  # the store gone: the reporter will name this rank silent
            logger.warning("global rank %d could not tell its state: %s", self._board.me, e)

    def write(self, own: dict) -> str:
        """Collect the others' states (at most ``wait_s`` seconds), write the report file,
        log its head; return the file's path."""
        said = self._board.collect("state", self.wait_s, job=True)
        states = {rank: json.loads(value) for rank, value in said.items()}
        states[self._board.me] = own
        text = report_text(states, list(self._board.job_ranks), self._board.me, self.job)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w") as f:
            f.write(text)
        head = text.splitlines()[:LOG_LINES]
        logger.error("%s\n(full report: %s)", "\n".join(head), self.path)
        return self.path
