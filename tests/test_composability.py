"""RRFP inside PP x DP (FSDP2, DDP), PP x TP (DTensor) and with torch.compile'd stages.

CPU, gloo, 4 processes per world (2 for compile), hard timeouts.
"""

from __future__ import annotations

import copy
import inspect
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from rrfp import ScheduleRRFP, Settings
from rrfp.testing.chains import (BATCH_PER_MICROBATCH, bitwise_equal, build_stages,
                                 coordinated_runs, DIM, local_stage_indices, loss_fn, make_batch,
                                 make_chain, MLPBlock, reference_steps, run_steps, torch_schedule)
from rrfp.testing.emulation import EmulatedDevice
from rrfp.testing.study import Study, StudySchedule
from rrfp.testing.timing import (random_device_time, random_send_delay, replicas_apart,
                                 SECOND_ACTIVATION_LATE)
from rrfp.testing.worlds import run_local_world


def data_parallel(rank: int, world_size: int, wrapper: str, hint: str, reference: str,
                  layout: str, delay_seeds: tuple[int, ...]) -> dict:
    """PP=2 x DP=2 (FSDP2 or DDP per stage); delays differ between the DP replicas, and
    in the first delayed run late messages make them interleave differently
    (``replicas_apart``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    num_stages, M, steps = 4, 4, 3
    chain = make_chain(num_stages)
    x_all, y_all = make_batch(2 * M)
    per_replica = M * BATCH_PER_MICROBATCH
    x, y = x_all[dp * per_replica:(dp + 1) * per_replica], y_all[dp * per_replica:(dp + 1) * per_replica]
    local = local_stage_indices(pp, 2, num_stages, layout)

    def build(seed: int | None):
        blocks, stages = [], []
        for s in local:
            block = copy.deepcopy(chain[s])
            module = block if seed is None else random_device_time(seed * 10 + dp, s, M, 0.003)(block)
            if wrapper == "fsdp":
                fully_shard(module, mesh=mesh["dp"])
                module.set_force_sum_reduction_for_comms(True)
            else:
                module = DistributedDataParallel(module, process_group=mesh["dp"].get_group())
            blocks.append(block)
            stages.append(PipelineStage(module, s, num_stages, torch.device("cpu"),
                                        group=mesh["pp"].get_group()))
        return stages, blocks

    def local_grads(history):
        return [([g.to_local() if hasattr(g, "to_local") else g for g in grads], losses)
                for grads, losses in history]

    stages, blocks = build(None)
    if wrapper == "ddp":
        # torch 2.13's own schedules trip an internal assert of DDP's reducer when a stage
        # runs several microbatch backwards ("rebuilt parameter indices size is not same as
        # original"), so the fixed order is run by ScheduleRRFP's "fixed" policy instead.
        baseline = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint=reference,
                                settings=Settings(policy="fixed"))
    else:
        baseline = torch_schedule(reference, stages, M)
    fixed = local_grads(run_steps(baseline, stages, blocks, x, y, steps))
    full = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for b in blocks for p in b.parameters()]
    ref = reference_steps(chain, x_all, y_all, steps, local)
    ref_error = max((g - r).abs().max().item() for g, r in zip(full, ref[-1][0]))
    runs = {}
    for seed in (None, *delay_seeds):
        stages, blocks = build(seed)
        # The first delayed run also makes the replicas interleave differently.
        late = replicas_apart(hint, dp) if seed == delay_seeds[0] else None
        send_delay = None if seed is None else random_send_delay(seed * 7919 + rank, 0.003, late)
        schedule = StudySchedule(stages, M, loss_fn=loss_fn, hint=hint,
                                 settings=Settings(buffer_limit="hint+1", policy="hint",
                                                   stall_timeout=60),
                                 study=Study(send_delay=send_delay))
        history = local_grads(run_steps(schedule, stages, blocks, x, y, steps))
        runs["plain" if seed is None else f"seed{seed}"] = {
            "bitwise": bitwise_equal(history, fixed),
            "realized": schedule.last_step_stats.realized_order,
        }
    return {"dp": dp, "pp": pp, "runs": runs, "ref_error": ref_error}


@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
@pytest.mark.parametrize("hint,layout", [("Interleaved1F1B", "loop"), ("ZBVZeroBubble", "v")])
def test_pipeline_x_data_parallel_is_bitwise_fixed_when_replicas_interleave_differently(
        wrapper, hint, layout):
    ranks = run_local_world(4, data_parallel, wrapper, hint, hint, layout, (1, 2, 3),
                            timeout=240)
    for result in ranks:
        for run, outcome in result["runs"].items():
            assert outcome["bitwise"], f"dp {result['dp']} pp {result['pp']} {run}"
        assert result["ref_error"] < 1e-12
    by_replica = {(r["dp"], r["pp"]): r["runs"] for r in ranks}
    assert any(by_replica[(0, pp)][run]["realized"] != by_replica[(1, pp)][run]["realized"]
               for pp in (0, 1) for run in ("seed1", "seed2", "seed3")), (
        "the replicas never interleaved differently: the test did not exercise ordering")


def gradient_accumulation(rank: int, world_size: int) -> dict:
    """PP 2 x FSDP 2, 1F1B: ``step(finalize_gradients=False)`` then a finalizing step, on
    two batches, under RRFP with random delays that differ between the replicas and a late
    activation that reorders actions. Against
    torch's own schedule making the same two calls where torch has the argument (2.15),
    and against the non-pipelined model over both batches on every version."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    num_stages, M = 2, 4
    chain = make_chain(num_stages)
    batches = [make_batch(2 * M, seed=seed) for seed in (1, 2)]
    per_replica = M * BATCH_PER_MICROBATCH
    replica = slice(dp * per_replica, (dp + 1) * per_replica)

    def build(seed: int | None):
        block = copy.deepcopy(chain[pp])
        module = block if seed is None else random_device_time(seed * 10 + dp, pp, M, 0.003)(block)
        fully_shard(module, mesh=mesh["dp"])
        module.set_force_sum_reduction_for_comms(True)
        stage = PipelineStage(module, pp, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
        return stage, block

    def accumulate(schedule, stage, block) -> dict:
        unsharded_between = []
        for i, (x, y) in enumerate(batches):
            inputs = (x[replica],) if stage.is_first else ()
            schedule.step(*inputs, target=y[replica], finalize_gradients=i == 1)
            if i == 0:
                unsharded_between = [p.shape == q.shape for p, q in
                                     zip(block.parameters(), chain[pp].parameters())]
        return {"grads": [p.grad.to_local().clone() for p in block.parameters()],
                "full": [p.grad.full_tensor() for p in block.parameters()],
                "unsharded_between": all(unsharded_between)}

    result = {}
    stage, block = build(None)
    fixed = torch_schedule("1F1B", [stage], M)
    if "finalize_gradients" in inspect.signature(fixed.step).parameters:
        result["torch"] = accumulate(fixed, stage, block)
    stage, block = build(3)
    rrfp = StudySchedule(stage, M, loss_fn=loss_fn, hint="1F1B",
                         settings=Settings(buffer_limit="hint+1", policy="hint", stall_timeout=60),
                         study=Study(device=EmulatedDevice(),
                                     send_delay=random_send_delay(3 * 7919 + rank, 0.003,
                                                     SECOND_ACTIVATION_LATE)))
    result["rrfp"] = accumulate(rrfp, stage, block)
    result["out_of_order"] = rrfp.last_step_stats.out_of_hint_order
    rrfp.close()
    reference = [copy.deepcopy(b) for b in chain]
    total = 0
    for x, y in batches:
        out = x
        for b in reference:
            out = b(out)
        total = total + loss_fn(out, y)
    total.backward()
    result["error"] = max((g - p.grad).abs().max().item()
                          for g, p in zip(result["rrfp"]["full"], reference[pp].parameters()))
    if "torch" in result:
        result["bitwise"] = all(torch.equal(a, b) for a, b in
                                zip(result["rrfp"]["grads"], result["torch"]["grads"]))
    for run in ("rrfp", "torch"):
        if run in result:
            del result[run]["grads"], result[run]["full"]
    return result


def test_gradients_accumulate_over_steps_that_do_not_finalize_them():
    """``step(finalize_gradients=False)`` (torch 2.15's argument, on every version): FSDP
    parameters stay unsharded and gradients unreduced until the finalizing step, whose
    gradients are those of both batches: bitwise torch's own schedule where torch has the
    argument, and within 1e-12 of the non-pipelined model (the only baseline on 2.13/2.14)."""
    ranks = run_local_world(4, gradient_accumulation, timeout=240)
    for result in ranks:
        assert result["rrfp"] == {"unsharded_between": True}, result
        assert result["error"] < 1e-12, result
        if "torch" in result:
            assert result["torch"] == result["rrfp"], result
            assert result["bitwise"], result
    assert any(r["out_of_order"] for r in ranks), "the delays never reordered an action"


def agree_when_policies_differ(rank: int, world_size: int) -> dict:
    """Two ranks of a coordination group whose policies rank the same two ready actions
    (pipeline rank 1 of 1F1B after its first forward: B0, and F1 whose input is here)
    oppositely: they must still settle on one action, the hint's next."""
    from rrfp.core.arbiter import Arbiter
    from rrfp.comm.coordination import AgreeOnProposals
    from rrfp.core.actions import Edge
    from rrfp.core.hints import build_hint

    class Opposite:
        name = "opposite"

        def choose(self, ready, arbiter):
            return ready[rank % 2 - 1]

        def lead(self, arbiter):
            return arbiter.first_undone

    hint = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=4)
    arbiter = Arbiter(hint, 1, policy=Opposite())
    for mb in (0, 1):
        arbiter.deliver(Edge(0, 1), mb, at=0.0)
    arbiter.record_launch(arbiter.choose())
    coordinator = AgreeOnProposals(dist.group.WORLD, stall_timeout=10)
    for round_ in range(1, 6):
        agreed = coordinator.settle(arbiter.choose(), arbiter, time.sleep)
        if agreed is not None:
            return {"agreed": str(agreed), "hint_next": str(hint.orders[1][1]), "rounds": round_}
    return {"agreed": None, "rounds": round_}


def test_agreement_settles_when_the_ranks_policies_rank_actions_differently():
    for result in run_local_world(2, agree_when_policies_differ, timeout=180):
        assert result["agreed"] == result["hint_next"], result
        assert result["rounds"] == 2, result  # one disagreement, then the hint's next


def tensor_parallel(rank: int, world_size: int, coordination: str, hint: str, reference: str,
                    layout: str, delay_seeds: tuple[int, ...]) -> dict:
    """PP=2 x TP=2 with a DTensor MLP per stage; delays differ between the TP ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, parallelize_module, RowwiseParallel)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    num_stages, M, steps = 4, 4, 3
    torch.manual_seed(0)
    chain = [MLPBlock().double() for _ in range(num_stages)]
    x, y = make_batch(M)
    local = local_stage_indices(pp, 2, num_stages, layout)

    def build(seed: int | None):
        blocks, stages = [], []
        for s in local:
            block = parallelize_module(copy.deepcopy(chain[s]), mesh["tp"],
                                       {"up": ColwiseParallel(), "down": RowwiseParallel()})
            module = block if seed is None else random_device_time(seed * 10 + tp, s, M, 0.003)(block)
            blocks.append(block)
            stages.append(PipelineStage(module, s, num_stages, torch.device("cpu"),
                                        group=mesh["pp"].get_group()))
        return stages, blocks

    def local_grads(history):
        return [([g.to_local() for g in grads], losses) for grads, losses in history]

    stages, blocks = build(None)
    fixed = local_grads(run_steps(torch_schedule(reference, stages, M), stages, blocks, x, y, steps))
    full = [p.grad.full_tensor() for b in blocks for p in b.parameters()]
    ref = reference_steps(chain, x, y, steps, local)
    ref_error = max((g - r).abs().max().item() for g, r in zip(full, ref[-1][0]))
    runs = coordinated_runs(rank, build, local_grads, fixed, hint, M, mesh["tp"].get_group(),
                            coordination, delay_seeds, x, y, steps)
    return {"pp": pp, "tp": tp, "runs": runs, "ref_error": ref_error}


@pytest.mark.parametrize("coordination", ["leader", "agree"])
@pytest.mark.parametrize("hint", ["Interleaved1F1B", "BF"])
def test_pipeline_x_tensor_parallel_coordinates_the_tp_ranks(coordination, hint):
    # torch 2.13's own ZBV schedule fails on DTensor TP stages (an in-place detach of a
    # view in its backward-input path), so the V layout has no fixed schedule to compare.
    ranks = run_local_world(4, tensor_parallel, coordination, hint, "Interleaved1F1B",
                            "loop", (1, 2), timeout=240)
    for result in ranks:
        assert result["ref_error"] < 1e-12
        for run, outcome in result["runs"].items():
            assert outcome["bitwise"], f"pp {result['pp']} tp {result['tp']} {run}"
            assert outcome["rounds"] >= 18  # at least one settlement per action
            if coordination == "leader":
                assert outcome["deferrals"] == 0
    assert any(outcome["out_of_order"] for r in ranks for outcome in r["runs"].values()), (
        "no action ran out of the hint's order: the coordination was not put to the test")
    by_rank = {(r["pp"], r["tp"]): r["runs"] for r in ranks}
    for pp in (0, 1):
        for run in by_rank[(pp, 0)]:
            assert by_rank[(pp, 0)][run]["realized"] == by_rank[(pp, 1)][run]["realized"]


def compiled_stages(rank: int, world_size: int, hint: str, reference: str, per_rank: int,
                    layout: str) -> dict:
    """torch.compile'd stage modules under RRFP vs the uncompiled fixed schedule."""
    import torch._dynamo

    num_stages, M, steps = world_size * per_rank, 4, 3
    chain = make_chain(num_stages)
    x, y = make_batch(M)
    stages, blocks = build_stages(chain, rank, world_size, layout)
    fixed = run_steps(torch_schedule(reference, stages, M), stages, blocks, x, y, steps)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    # Random delays outside the compiled module, and a late activation that makes actions
    # run out of the hint's order.
    stages, blocks = build_stages(
        chain, rank, world_size, layout,
        wrap=lambda s, b: random_device_time(3, s, M, 0.003)(torch.compile(b, backend="aot_eager")))
    schedule = StudySchedule(stages, M, loss_fn=loss_fn, hint=hint,
                             settings=Settings(buffer_limit="hint+1", policy="hint"),
                             study=Study(send_delay=random_send_delay(
                                 rank, 0.003, SECOND_ACTIVATION_LATE)))
    compiled = run_steps(schedule, stages, blocks, x, y, 1)
    after_first = (sum(counters["frames"].values()), sum(counters["recompiles"].values()))
    compiled += run_steps(schedule, stages, blocks, x, y, steps - 1)
    after_all = (sum(counters["frames"].values()), sum(counters["recompiles"].values()))
    out_of_order = schedule.last_step_stats.out_of_hint_order
    schedule.close()
    return {"bitwise": bitwise_equal(compiled, fixed), "after_first": after_first,
            "out_of_order": out_of_order,
            "after_all": after_all, "unique_graphs": counters["stats"]["unique_graphs"]}


@pytest.mark.parametrize("hint,reference,per_rank", [
    ("Interleaved1F1B", "Interleaved1F1B", 2), ("BF", "1F1B", 1),
])
def test_compiled_stages_match_the_uncompiled_fixed_schedule_without_recompiling(
        hint, reference, per_rank):
    ranks = run_local_world(2, compiled_stages, hint, reference, per_rank, "loop",
                            timeout=300)
    assert any(result["out_of_order"] for result in ranks), ranks  # the order was put to the test
    for result in ranks:
        assert result["bitwise"]
        assert result["after_first"][0] > 0
        assert result["after_all"] == result["after_first"]  # no frame compiled after step 1
        assert result["after_all"][1] == 0  # no recompilation at all


def refused_data_parallel(rank: int, world_size: int, case: str) -> str:
    """Data-parallel stage set-ups ScheduleRRFP must refuse (one-stage pipelines, DP over
    both ranks): DDP broadcasting buffers in forward, DDP with a communication hook, FSDP
    modules inside a stage that is not one itself."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    pp_group = dist.new_group([rank])
    if case == "ddp_buffers":
        block = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.BatchNorm1d(DIM)).double()
        module = DistributedDataParallel(block)
    elif case == "ddp_comm_hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        module = DistributedDataParallel(torch.nn.Linear(DIM, DIM).double())
        module.register_comm_hook(None, allreduce_hook)
    elif case == "fsdp_inner_only":
        module = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Linear(DIM, DIM)).double()
        fully_shard(module[0])
    else:
        raise AssertionError(case)
    stage = PipelineStage(module, 0, 1, torch.device("cpu"), group=pp_group)
    try:
        ScheduleRRFP(stage, 2, loss_fn=loss_fn, hint="GPipe")
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError")


@pytest.mark.parametrize("case,expected", [
    ("ddp_buffers", "broadcast_buffers=False"),
    ("ddp_comm_hook", "communication hook"),
    ("fsdp_inner_only", "apply fully_shard to the stage module too"),
])
def test_data_parallel_set_ups_rrfp_cannot_keep_in_lockstep_are_refused(case, expected):
    for message in run_local_world(2, refused_data_parallel, case, timeout=180):
        assert expected in message, message


def test_ddp_gradients_are_reduced_in_buckets_of_at_most_the_cap():
    from rrfp.runtime.data_parallel import gradient_buckets

    grads = [torch.zeros(n) for n in (10, 20, 30, 100, 5, 5)]  # float32: 4 bytes each
    buckets = gradient_buckets(grads, cap_bytes=160)
    assert [[g.numel() for g in b] for b in buckets] == [[10, 20], [30], [100], [5, 5]]
    assert [g for b in buckets for g in b] == grads


DDP_BUCKET_CAP_BYTES = 600
"""Smaller than two of the DDP worker's weight gradients (512 B each), larger than one
with its bias (576 B): several buckets, the largest 576 B."""


def ddp_buckets(rank: int, world_size: int) -> dict:
    """A one-stage pipeline per rank, its stage wrapped in DDP over both ranks (two Linear
    layers, float64): the tensors ``all_reduce`` is given while ScheduleRRFP reduces the
    gradients at REDUCE_GRAD, and the gradients against the same model on both ranks' data
    without DDP or pipelining."""
    from torch.nn.parallel import DistributedDataParallel

    pp_group = dist.new_group([rank])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Linear(DIM, DIM)).double()
    reference = copy.deepcopy(model)
    x_all, y_all = make_batch(2 * world_size)
    x, y = x_all.chunk(world_size)[rank], y_all.chunk(world_size)[rank]
    ddp = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_CAP_BYTES / 2**20)
    stage = PipelineStage(ddp, 0, 1, torch.device("cpu"), group=pp_group)
    schedule = ScheduleRRFP(stage, 2, loss_fn=loss_fn, hint="GPipe")
    reduced: list[int] = []
    all_reduce = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        reduced.append(tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        schedule.step(x, target=y)
    finally:
        dist.all_reduce = all_reduce
    schedule.close()
    # Per replica the mean over its 2 microbatches, averaged over the replicas: the mean
    # over all 4 microbatches of the whole batch.
    loss = sum(loss_fn(reference(xm), ym) for xm, ym in zip(x_all.chunk(4), y_all.chunk(4))) / 4
    loss.backward()
    error = max((p.grad - r.grad).abs().max().item()
                for p, r in zip(model.parameters(), reference.parameters()))
    return {"reduced": reduced, "cap": ddp.bucket_bytes_cap, "error": error,
            "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def test_ddp_reduces_in_buckets_no_larger_than_its_bucket_cap():
    """The extra memory of DDP's reduction is one bucket: every tensor all_reduce sees is at
    most DDP's bucket_bytes_cap (several buckets here), and the gradients are the
    replicas' mean."""
    for result in run_local_world(2, ddp_buckets, timeout=180):
        assert result["cap"] == DDP_BUCKET_CAP_BYTES
        assert len(result["reduced"]) >= 2, result
        assert max(result["reduced"]) <= result["cap"] < result["gradient_bytes"], result
        assert sum(result["reduced"]) == result["gradient_bytes"], result
        assert result["error"] < 1e-12, result


def fsdp_collectives(rank: int, world_size: int) -> dict:
    """PP=2 x FSDP=2, Interleaved1F1B (two stages per rank), random delays that differ
    between the replicas and late messages that make them interleave differently
    (``replicas_apart``): the order of the
    data-parallel collectives and of the stages' actions in the second step (the first
    step's shape inference runs forwards outside the schedule's order)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    num_stages, M = 4, 4
    chain = make_chain(num_stages)
    x, y = make_batch(M, seed=1 + dp)
    local = local_stage_indices(pp, 2, num_stages, "loop")
    log: list[tuple] = []
    stages, blocks = [], []
    for s in local:
        block = copy.deepcopy(chain[s])
        module = random_device_time(10 + dp, s, M, 0.003)(block)
        fully_shard(module, mesh=mesh["dp"])
        module.set_force_sum_reduction_for_comms(True)
        module.register_forward_pre_hook(lambda m, args, s=s: log.append(("F", s)))
        blocks.append(block)
        stage = PipelineStage(module, s, num_stages, torch.device("cpu"),
                              group=mesh["pp"].get_group())
        reduce_grad = stage.perform_reduce_grad

        def logged(*args, s=s, reduce_grad=reduce_grad, **kwargs):
            log.append(("REDUCE_GRAD", s))
            reduce_grad(*args, **kwargs)
            log.append(("REDUCE_GRAD done", s))
        stage.perform_reduce_grad = logged
        stages.append(stage)
    # Readiness-first: the default here (lookahead) would let an action pass a late one
    # only if earlier steps' arrival times, noisy on a loaded machine, said it fits.
    schedule = StudySchedule(stages, M, loss_fn=loss_fn, hint="Interleaved1F1B",
                             settings=Settings(buffer_limit="hint+1", policy="hint",
                                               stall_timeout=60),
                             study=Study(send_delay=random_send_delay(
                                 10 + rank, 0.003, replicas_apart("Interleaved1F1B", dp))))
    originals = {name: getattr(dist, name)
                 for name in ("all_gather_single", "reduce_scatter_single",
                              "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")}

    def recording(name):
        def collective(*args, **kwargs):
            log.append((name,))
            return originals[name](*args, **kwargs)
        return collective

    run_steps(schedule, stages, blocks, x, y, 1)
    log.clear()
    for name in originals:
        setattr(dist, name, recording(name))
    try:
        run_steps(schedule, stages, blocks, x, y, 1)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    stats = schedule.last_step_stats
    schedule.close()
    return {"dp": dp, "pp": pp, "log": log, "out_of_order": stats.out_of_hint_order,
            "realized": stats.realized_order,
            "reduce_order": [a.stage_index for a in schedule.hint.orders[pp]
                             if a is not None and a.computation_type.value == "REDUCE_GRAD"]}


def test_fsdp_unshards_for_the_whole_step_and_reduce_scatters_at_reduce_grad_in_stage_order():
    """The data-parallel collectives of a step, in order: the stages' all-gathers before
    any forward, none during the step; reduce-scatters only inside REDUCE_GRAD, whose stage
    order is the hint's on every replica; replicas that interleave their actions
    differently."""
    ranks = run_local_world(4, fsdp_collectives, timeout=180)
    gathers = ("all_gather_single", "all_gather_into_tensor")
    scatters = ("reduce_scatter_single", "reduce_scatter_tensor")
    for result in ranks:
        log = result["log"]
        first_forward = next(i for i, e in enumerate(log) if e[0] == "F")
        assert [e for e in log[first_forward:] if e[0] in gathers] == [], log
        assert sum(e[0] in gathers for e in log[:first_forward]) == 2, log  # one per stage
        assert [e[1] for e in log if e[0] == "REDUCE_GRAD"] == result["reduce_order"]
        inside = False
        for event in log:
            if event[0] == "REDUCE_GRAD":
                inside, scattered = True, 0
            elif event[0] == "REDUCE_GRAD done":
                assert scattered >= 1, log
                inside = False
            elif event[0] in scatters:
                assert inside, log
                scattered += 1
    by_replica = {(r["dp"], r["pp"]): r["realized"] for r in ranks}
    assert any(by_replica[(0, pp)] != by_replica[(1, pp)] for pp in (0, 1)), (
        "the replicas did not interleave differently: the order was not put to the test")


def tensor_parallel_peer_stops(rank: int, world_size: int, coordination: str) -> dict:
    """PP 2 x TP 2; after one step, global rank 0 (the TP leader of pipeline rank 0)
    stops stepping. Every other rank must raise PipelineStallError within about the stall
    timeout (5 s), naming a peer, not wait for gloo's own timeout (120 s). With 2 s, the
    first step's coordination once took longer than that at load 6-9."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, parallelize_module, RowwiseParallel)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp = mesh["pp"].get_local_rank()
    num_stages, M = 4, 4
    torch.manual_seed(0)
    chain = [MLPBlock().double() for _ in range(num_stages)]
    x, y = make_batch(M)
    local = local_stage_indices(pp, 2, num_stages, "loop")
    blocks = [parallelize_module(copy.deepcopy(chain[s]), mesh["tp"],
                                 {"up": ColwiseParallel(), "down": RowwiseParallel()})
              for s in local]
    stages = [PipelineStage(b, s, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
              for b, s in zip(blocks, local)]
    schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="Interleaved1F1B",
                            coordination_group=mesh["tp"].get_group(),
                            settings=Settings(stall_timeout=5.0, coordination=coordination))
    run_steps(schedule, stages, blocks, x, y, 1)
    outcome: dict = {}
    if rank != 0:
        start = time.perf_counter()
        try:
            run_steps(schedule, stages, blocks, x, y, 1)
        except Exception as e:
            outcome = {"error": f"{type(e).__name__}: {e}", "elapsed": time.perf_counter() - start}
    return outcome


@pytest.mark.parametrize("coordination", ["leader", "agree"])
def test_tensor_parallel_ranks_raise_within_the_stall_timeout_when_a_peer_stops(coordination):
    ranks = run_local_world(4, tensor_parallel_peer_stops, coordination, timeout=120)
    assert ranks[0] == {}
    for rank in (1, 2, 3):
        outcome = ranks[rank]
        assert outcome["error"].startswith(("PipelineStallError", "PeerFailedError",
                                            "RuntimeError")), outcome
        assert outcome["elapsed"] < 20.0, outcome
    # The TP follower of the stopped leader names it: by its own stall, or through the first
    # failure of the job (a receive from global rank 0 that failed as its process ended).
    assert ranks[1]["error"].startswith(("PipelineStallError", "PeerFailedError"))
    assert "global rank 0" in ranks[1]["error"], ranks[1]["error"]


def _tensor_parallel_block(local_output: bool | None):
    """This rank's block of a 2-stage chain under PP 2 x TP 2 (column- then row-parallel),
    with the mesh, its pipeline rank and the batch; ``local_output``: whether the block's
    output is a plain tensor (None: only the last stage's, so activations travel as
    DTensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, parallelize_module, RowwiseParallel)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    chain = [MLPBlock().double() for _ in range(2)]
    x, y = make_batch(2)
    down = RowwiseParallel(use_local_output=pp == 1 if local_output is None else local_output)
    block = parallelize_module(copy.deepcopy(chain[pp]), mesh["tp"],
                               {"up": ColwiseParallel(), "down": down})
    return mesh, pp, block, x, y


def tensor_parallel_without_coordination(rank: int, world_size: int) -> str:
    """PP 2 x TP 2 with DTensor stages but no coordination group: every rank must refuse."""
    mesh, pp, block, x, y = _tensor_parallel_block(local_output=True)
    stage = PipelineStage(block, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleRRFP(stage, 2, loss_fn=loss_fn, hint="1F1B",
                            settings=Settings(stall_timeout=30))
    try:
        run_steps(schedule, [stage], [block], x, y, 1)
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError")


def test_dtensor_stages_without_a_coordination_group_are_refused_on_every_rank():
    for message in run_local_world(4, tensor_parallel_without_coordination, timeout=180):
        assert "no coordination_group is given" in message and "DTensor" in message


def dtensor_variable_shapes(rank: int, world_size: int) -> str:
    """PP 2 x TP 2, the first stage's output a DTensor (``use_local_output=False``), so
    that activations and their gradients travel as DTensors, with ``variable_shapes=True``:
    what each rank's first step raises."""
    mesh, pp, block, x, y = _tensor_parallel_block(local_output=None)
    stage = PipelineStage(block, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group(),
                          get_mesh=lambda names, layout: mesh[names])
    schedule = ScheduleRRFP(stage, 2, loss_fn=loss_fn, hint="1F1B",
                            coordination_group=mesh["tp"].get_group(),
                            settings=Settings(stall_timeout=5, variable_shapes=True))
    xs, ys = list(x.chunk(2)), list(y.chunk(2))
    try:
        schedule.step(arg_mbs=[(t,) for t in xs] if pp == 0 else None,
                      target_mbs=ys if pp == 1 else None)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        schedule.close()
    return "no error"


def test_variable_shapes_refuse_dtensor_activations():
    """Received DTensors are rebuilt with the global shape fixed at shape inference, so
    variable shapes cannot hold: every rank refuses at its first step, saying why."""
    for rank, message in enumerate(run_local_world(4, dtensor_variable_shapes,
                                                   timeout=120)):
        assert message.startswith("ValueError: variable_shapes: stage "), (rank, message)
        assert "receives a DTensor activation or gradient" in message, (rank, message)


def shared_parameters(rank: int, world_size: int) -> list[str]:
    """V placement over 2 ranks: rank 0 holds stages 0 and 3; tie their weights."""
    import warnings

    chain = make_chain(4)
    chain[3][0].weight = chain[0][0].weight
    indices = local_stage_indices(rank, world_size, 4, "v")
    stages = [PipelineStage(chain[s], s, 4, torch.device("cpu")) for s in indices]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schedule = ScheduleRRFP(stages, 4, loss_fn=loss_fn, hint="ZBVZeroBubble")
    schedule.close()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)
            and "share parameters" in str(w.message)]


def test_parameters_shared_by_a_ranks_stages_are_reported():
    rank0, rank1 = run_local_world(2, shared_parameters, timeout=180)
    assert len(rank0) == 1 and "stages 0 and 3" in rank0[0]
    assert rank1 == []
