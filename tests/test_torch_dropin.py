"""Code written for torch's schedules runs on ScheduleRRFP: hints loaded after
construction, custom functions, torch's runtime interface, and a schedule that stays
usable after an error raised before any communication (torch's own tests, adapted, are in
tests/torch_adapted/)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining._utils import PipeliningMetadataError
from torch.distributed.pipelining.schedules import (
    _PipelineScheduleRuntime,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from rrfp import ScheduleRRFP, Settings
from rrfp.testing.callbacks import torch_style_callbacks
from rrfp.testing.chains import (bitwise_equal, build_stages, loss_fn, make_batch, make_chain,
                                 run_steps)
from rrfp.testing.probes import error_chain
from rrfp.testing.worlds import run_local_world

M = 4


def loaded_hints(rank: int, world_size: int, tmpdir: str) -> dict:
    """ScheduleRRFP built with LoopedBFS, then given torch's Interleaved1F1B as a CSV
    (compute-only, then compute+comms): what it ranks by, and its results against torch's
    Interleaved1F1B; a CSV of another placement, and an unknown format, are refused."""
    chain = make_chain(2 * world_size)
    x, y = make_batch(M)
    stages, blocks = build_stages(chain, rank, world_size, "loop")
    torch_fixed = ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn)
    fixed = run_steps(torch_fixed, stages, blocks, x, y, 2)
    paths = {fmt: f"{tmpdir}/interleaved_{fmt}.csv" for fmt in ("compute_only", "compute_comms")}
    v_path = f"{tmpdir}/zbv.csv"
    if rank == 0:
        for fmt, path in paths.items():
            torch_fixed._dump_csv(path, format=fmt)
        v_stages, _ = build_stages(chain, rank, world_size, "v")
        ScheduleZBVZeroBubble(v_stages, M, loss_fn=loss_fn)._dump_csv(v_path, format="compute_only")
    dist.barrier()

    result: dict = {"torch_order": [str(a) for a in torch_fixed.pipeline_order[rank] if a]}
    for fmt, path in paths.items():
        stages, blocks = build_stages(chain, rank, world_size, "loop")
        schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="LoopedBFS")
        result[f"before_{fmt}"] = [str(a) for a in schedule.pipeline_order[rank]]
        schedule._load_csv(path, format=fmt)
        history = run_steps(schedule, stages, blocks, x, y, 2)
        result[f"after_{fmt}"] = [a for a in schedule.last_step_stats.hint_order
                                  if "REDUCE_GRAD" not in a]
        result[f"bitwise_{fmt}"] = bitwise_equal(history, fixed)
        result[f"hint_name_{fmt}"] = schedule.hint.name
        for call, name in ((lambda: schedule._load_csv(v_path), "other_placement"),
                           (lambda: schedule._load_csv(path, format="comms"), "unknown_format")):
            try:
                call()
                result[name] = None
            except (ValueError, NotImplementedError) as e:
                result[name] = error_chain(e)
        schedule.close()
    result["stalling_fixed_steps"] = fixed_steps_stall_on_a_loaded_hint(rank, world_size, tmpdir)
    return result


def fixed_steps_stall_on_a_loaded_hint(rank: int, world_size: int, tmpdir: str) -> str | None:
    """The in-run A/B's fixed-order steps at limits that fit the constructor's hint (1F1B
    at 2 microbatches per stage) but not a loaded one (GPipe holds all 4): the load is
    refused (None: accepted)."""
    path = f"{tmpdir}/gpipe.csv"
    if rank == 0:
        with open(path, "w") as f:
            for r in range(world_size):
                f.write(",".join([f"{r}F{mb}" for mb in range(M)] + [f"{r}B{mb}" for mb in range(M)])
                        + "\n")
    dist.barrier()
    stages, _ = build_stages(make_chain(world_size), rank, world_size, "loop")
    schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="1F1B",
                            settings=Settings(buffer_limit=2, fixed_every=2))
    try:
        schedule._load_csv(path)
        return None
    except ValueError as e:
        return str(e)
    finally:
        schedule.close()


def test_a_csv_loaded_after_construction_becomes_the_hint(tmp_path):
    ranks = run_local_world(2, loaded_hints, str(tmp_path), timeout=180)
    for rank, result in enumerate(ranks):
        for fmt in ("compute_only", "compute_comms"):
            assert result[f"before_{fmt}"] != result["torch_order"], "the orders must differ"
            assert result[f"after_{fmt}"] == result["torch_order"], (rank, fmt)
            assert result[f"bitwise_{fmt}"], f"rank {rank}, {fmt}: differs from torch's"
            assert result[f"hint_name_{fmt}"] == f"interleaved_{fmt}.csv"
            assert "build a ScheduleRRFP with hint='zbv.csv'" in result["other_placement"]
            assert result["unknown_format"] == "NotImplementedError: format='comms' is not implemented"
        assert result["stalling_fixed_steps"].startswith(
            "fixed_every: fixed_every=2 runs hint 'gpipe.csv' in its own order, which holds up to 4 "
            "microbatches on stage 0, but buffer_limit=2 allows 2: it would stall"), rank


class Counting(torch.nn.Module):
    """A stage module that counts its forwards."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.forwards = inner, 0

    def forward(self, x):
        self.forwards += 1
        return self.inner(x)


def custom_functions(rank: int, world_size: int) -> dict:
    """The same FORWARD and FULL_BACKWARD callbacks on torch's Interleaved1F1B and on
    ScheduleRRFP with it as hint: what ran, the forwards the modules saw, the results;
    an OVERLAP_F_B callback is refused; what torch's runtime interface shows."""
    chain = make_chain(2 * world_size)
    x, y = make_batch(M)
    result: dict = {}
    for name in ("torch", "rrfp"):
        stages, blocks = build_stages(chain, rank, world_size, "loop",
                                      wrap=lambda s, b: Counting(b))
        schedule = (ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn) if name == "torch" else
                    ScheduleRRFP(stages, M, loss_fn=loss_fn, hint=ScheduleInterleaved1F1B))
        calls: list[str] = []
        forward, backward = torch_style_callbacks(calls)
        schedule.register_custom_function(FORWARD, forward)
        schedule.register_custom_function(FULL_BACKWARD, backward)
        history = run_steps(schedule, stages, blocks, x, y, 2)
        result[name] = {"history": history, "calls": sorted(calls),
                        "forwards": [stage.submod.forwards for stage in stages],
                        "runtime": isinstance(schedule, _PipelineScheduleRuntime)}
        if name == "rrfp":
            try:
                schedule.register_custom_function(OVERLAP_F_B, forward)
                result["overlap"] = None
            except ValueError as e:
                result["overlap"] = str(e)
            with_comms = schedule.pipeline_order_with_comms[schedule.rank]
            result["with_comms_kinds"] = sorted({a.computation_type.name for a in with_comms})
            result["with_comms_compute"] = [str(a) for a in with_comms if a.is_compute_op]
            result["compute"] = [str(a) for a in schedule.pipeline_order[schedule.rank]
                                 if a.is_compute_op]
            schedule.close()
    result["bitwise"] = bitwise_equal(result["rrfp"].pop("history"),
                                      result["torch"].pop("history"))
    return result


def test_custom_functions_replace_the_compute_of_their_actions_as_in_torchs_runtime():
    ranks = run_local_world(2, custom_functions, timeout=180)
    for rank, result in enumerate(ranks):
        assert result["bitwise"], f"rank {rank}: differs from torch's runtime with the callbacks"
        assert result["rrfp"] == result["torch"], rank
        assert len(result["rrfp"]["calls"]) == 2 * 2 * 2 * 4  # steps x stages x (F, B) x mbs
        # Each forward ran once (and once more in torch's first-step shape inference).
        assert result["rrfp"]["forwards"] == [2 * 4 + 1, 2 * 4 + 1]
        assert result["rrfp"]["runtime"]
        assert "register FORWARD and FULL_BACKWARD callbacks instead" in result["overlap"]
        assert {"SEND_F", "RECV_B"} <= set(result["with_comms_kinds"])
        assert result["with_comms_compute"] == result["compute"]


def reuse_after_input_error(rank: int, world_size: int, name: str) -> dict:
    """GPipe training with torch's shape checks on: rank 0's second step gets an input of
    the wrong shape and raises before any communication, while the other ranks are in
    that step; rank 0 then steps with the right input, and every rank goes on. The same
    sequence on torch's ScheduleGPipe and on ScheduleRRFP."""
    chain = make_chain(world_size)
    x, y = make_batch(M)
    stages, blocks = build_stages(chain, rank, world_size, "loop")
    for stage in stages:
        stage._runtime_validate = True  # torch's stages check shapes only then
    schedule = (ScheduleGPipe(stages[0], M, loss_fn=loss_fn) if name == "torch" else
                ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="GPipe",
                             settings=Settings(stall_timeout=60)))
    history = run_steps(schedule, stages, blocks, x, y, 1)
    error = None
    if rank == 0:
        wrong = torch.cat([x, x[:1]])
        try:
            schedule.step(wrong, target=y)
        except PipeliningMetadataError as e:
            error = error_chain(e)
    history += run_steps(schedule, stages, blocks, x, y, 2)
    if name == "rrfp":
        schedule.close()
    return {"history": history, "error": error}


def reference_reuse(rank: int, world_size: int) -> dict:
    """``reuse_after_input_error`` on torch's class and on RRFP, from the same parameters."""
    outcomes = {name: reuse_after_input_error(rank, world_size, name)
                for name in ("torch", "rrfp")}
    return {"errors": {name: o["error"] for name, o in outcomes.items()},
            "bitwise": bitwise_equal(outcomes["rrfp"]["history"], outcomes["torch"]["history"]),
            "steps": len(outcomes["rrfp"]["history"])}


def test_an_input_error_before_any_communication_leaves_the_schedule_usable():
    ranks = run_local_world(2, reference_reuse, timeout=240)
    assert "shape mismatch" in ranks[0]["errors"]["rrfp"], ranks[0]
    assert ranks[0]["errors"]["torch"].split(":")[0] == ranks[0]["errors"]["rrfp"].split(":")[0]
    for rank, result in enumerate(ranks):
        assert result["steps"] == 3
        assert result["bitwise"], f"rank {rank}: the steps after the error differ from torch's"
