"""The whole job, not one pipeline: a failure reaches every rank of every pipeline and
their replicas, a stall gets one report, and settings that differ between ranks are
refused before any step (``rrfp.job``, ``rrfp.hang_report``). Worlds of 4 processes on
gloo, or on NCCL-like channels and groups (``tests.nccl_like``,
``tests.nccl_like_collectives``); per-rank bodies in ``tests/job_workers.py``."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from rrfp import PipelineStallError
from rrfp.hang_report import find_holder, HANG_REPORT_WAIT_S, report_text, SILENT, UNSENT
from rrfp.job import agree_on_settings, JobScope
from rrfp.local import run_local_world
from tests import job_workers

SCENARIOS = [("gloo", "dp"), ("nccl-like", "dp")]
"""In the default run: PP 2 x FSDP 2 on gloo, PP 2 x DDP 2 on NCCL-like groups (the host
blocked in the collective: only the rank's own watch releases it)."""
MORE = [("gloo", "tp"), ("nccl-like", "tp")]
"""PP 2 x DTensor TP 2 on gloo, PP 2 x hand-made TP 2 on NCCL-like groups (the emulated
device blocked in the collective): ``-m job``."""


def _check_every_rank_names_rank_0(ranks: list[dict], bound: float) -> None:
    own = ranks[0]
    assert "forward failed on purpose" in own["error"], own["error"]
    for rank, result in enumerate(ranks[1:], start=1):
        error = result["error"]
        assert error is not None and error.startswith("PeerFailedError"), (rank, error)
        assert result["failed_rank"] == 0, (rank, error)
        # The first failed rank, the action it ran (its stage) and the cause.
        assert "(global rank 0) failed its step in stage 0 F microbatch 2" in error, error
        assert "forward failed on purpose" in error, error
        assert result["raised_at"] - result["struck_at"] < bound, (rank, result)
    for rank, result in enumerate(ranks):
        assert result["threads"] == [], (rank, result["threads"])


def _failure(kind: str, parallel: str) -> None:
    """``stall_timeout`` and the collective timeout 300 s; the other pipeline's ranks are
    blocked in collectives when rank 0 fails: every rank raises within 5 s naming it."""
    ranks = run_local_world(4, job_workers.job_failure, kind, parallel, "raise", 300.0,
                            timeout=240)
    _check_every_rank_names_rank_0(ranks, bound=5.0)


@pytest.mark.parametrize("kind,parallel", SCENARIOS)
def test_a_failure_in_one_pipeline_makes_every_rank_of_the_job_raise_naming_it(kind, parallel):
    _failure(kind, parallel)


@pytest.mark.job
@pytest.mark.parametrize("kind,parallel", MORE)
def test_a_failure_reaches_the_replicas_on_the_other_parallelisms(kind, parallel):
    _failure(kind, parallel)


@pytest.mark.job
@pytest.mark.parametrize("kind,parallel", SCENARIOS + MORE)
def test_a_rank_killed_mid_step_makes_every_other_rank_raise_never_hang(kind, parallel):
    """Global rank 0 is SIGKILLed where the previous test makes it raise: nothing is
    published. On gloo its closed connections fail its peers at once; on NCCL-like
    channels its pipeline peer stalls (``stall_timeout`` 5 s) and says so; every other
    rank learns it from the board. The rank that reports the stall first waits for the
    others' states (at most ``HANG_REPORT_WAIT_S``, the dead rank named silent)."""
    stall = 5.0
    ranks = run_local_world(4, job_workers.job_failure, kind, parallel, "kill", stall,
                            timeout=240, may_die={0})
    assert ranks[0] is None
    survivors = ranks[1:]
    waited = [r["raised_at"] - r["struck_at"] for r in survivors]
    assert all(w < stall + HANG_REPORT_WAIT_S + 1.0 for w in waited), waited
    assert sorted(waited)[-2] < stall + 1.0, waited  # all but the reporter at once
    for result in survivors:
        assert result["error"] is not None and result["threads"] == [], result


def test_a_planted_stall_gives_one_report_naming_the_rank_and_channel_that_hold_the_others(
        tmp_path):
    """A pipeline of 4; global rank 1 never sends its activation of microbatch 1 to stage
    2. Every rank stalls or learns of the stall; exactly one report is written, by the
    first rank to stall, and the others' errors point at it."""
    ranks = run_local_world(4, job_workers.planted_stall, str(tmp_path), timeout=120)
    (report,) = list(tmp_path.iterdir())
    first = report.read_text().splitlines()[0]
    assert first.startswith("rrfp hang report: global rank 1 on channel 1->2 holds the "
                            "others: it ran stage 1 F microbatch 1 but never sent microbatch 1"), first
    assert "4 of 4 ranks told their state; silent (said nothing within the report's wait): none" \
        in report.read_text()
    for rank, result in enumerate(ranks):
        assert "PipelineStallError" in result["error"], result["error"]
        assert f"hang report: {report}" in result["error"], (rank, result["error"])
        assert result["threads"] == []


@pytest.mark.parametrize("setting,message", [
    ("hint", r"hint is 1F1B \(orders \w+\) on global ranks 0-1 but GPipe \(orders \w+\) on "
             r"global ranks 2-3"),
    ("buffer_limit", r"buffer_limit is 'hint' on global ranks 0-1 but 'hint\+1' on global "
                     r"ranks 2-3")])
def test_ranks_that_disagree_on_the_hint_or_the_limit_are_refused_on_every_rank(setting, message):
    """PP 2 x DP 2, the second pipeline given another setting (a TOML edited on one node):
    every rank's ScheduleRRFP refuses with the same message, before any channel or step."""
    import re

    ranks = run_local_world(4, job_workers.settings_disagree, setting, timeout=120)
    errors = {result["error"] for result in ranks}
    assert len(errors) == 1, errors
    (error,) = errors
    assert error is not None and re.search(message, error), error
    assert error.startswith("the ranks of this job disagree on RRFP's settings")
    assert all(result["threads"] == [] for result in ranks)


def _state(rank: int, waits=(), channels=None, completed=(), on_device=()) -> dict:
    return {"rank": rank, "pipeline_rank": rank, "stages": [rank], "step": 0, "host": "h",
            "pid": 1, "in_step": True, "error": "", "launched": 1, "actions": 2,
            "last_launched": None, "last_completed": None, "completed": list(completed),
            "on_device": list(on_device), "ready": [], "waits": list(waits),
            "channels": channels or {}}


def _wait(action: str, peer: int, channel: str, mb: int) -> dict:
    return {"action": action, "reason": "its input", "peer": peer, "channel": channel,
            "microbatch": mb}


def test_the_holder_is_the_silent_rank_the_waits_lead_to_before_a_cycle_among_the_others():
    """Ranks 1 and 2 wait on each other (neither produced); rank 3 waits on rank 0, which
    said nothing: the silent rank is named, with the channel rank 3 waits on."""
    states = {
        1: _state(1, [_wait("stage 1 B microbatch 0", 2, "2->1", 0)]),
        2: _state(2, [_wait("stage 2 F microbatch 0", 1, "1->2", 0)]),
        3: _state(3, [_wait("stage 3 F microbatch 0", 0, "0->3", 0)]),
    }
    holder, led = find_holder(states, [0, 1, 2, 3])
    assert (holder.rank, holder.channel, holder.kind, led) == (0, "0->3", SILENT, [3])
    text = report_text(states, [0, 1, 2, 3], reporter=1, job="attempt-0-job-0")
    assert text.splitlines()[0].startswith("rrfp hang report: global rank 0 on channel 0->3 "
                                           "holds the others: it said nothing (silent")
    assert "3 of 4 ranks told their state; silent (said nothing within the report's wait): [0]" \
        in text


def test_a_message_sent_and_never_received_names_its_sender_and_channel():
    states = {
        0: _state(0, channels={"0->1": {"peer": 1, "receives": False, "sent": [0, 1],
                                        "arrived": [], "outstanding": []}},
                  completed=["0:F:0", "0:F:1"]),
        1: _state(1, [_wait("stage 1 F microbatch 1", 0, "0->1", 1)],
                  channels={"0->1": {"peer": 0, "receives": True, "sent": [],
                                     "arrived": [0], "outstanding": [1]}}),
    }
    holder, led = find_holder(states, [0, 1])
    assert (holder.rank, holder.channel, holder.kind, led) == (0, "0->1", UNSENT, [1])
    assert "it sent microbatch 1, which never arrived" in holder.why


def test_settings_are_compared_over_every_rank_of_the_job():
    """Ranks' settings as they said them in the store (ranks 1 and 2 said theirs before
    rank 0): one message naming each setting that differs and who holds which value."""
    store = dist.HashStore()
    job = JobScope("rrfp/attempt-0/job/0/", store, (0, 1, 2))
    store.set("settings/1", '{"buffer_limit": "\'hint\'", "policy": "None"}')
    store.set("settings/2", '{"buffer_limit": "\'hint+2\'", "policy": "None"}')
    with pytest.raises(ValueError, match=r"buffer_limit is 'hint' on global ranks 0-1 but "
                                         r"'hint\+2' on global ranks 2\. Give every rank"):
        agree_on_settings(job, {"buffer_limit": "'hint'", "policy": "None"}, timeout=5)
    agree_on_settings(JobScope("p/", dist.HashStore(), (0,)), {"a": "1"}, timeout=5)  # alone
    with pytest.raises(PipelineStallError,
                       match=r"global ranks \[1\] of the job did not say 'settings'"):
        agree_on_settings(JobScope("p/", dist.HashStore(), (0, 1)), {"a": "1"}, timeout=0.5)
