"""Custom functions written as for torch's runtime schedules (``register_custom_function``),
shared by the tests that run them on torch's schedules and on ScheduleRRFP."""

from __future__ import annotations

from torch.distributed.pipelining.schedules import (_PipelineContext, _PipelineScheduleRuntime,
                                                    _wait_batch_p2p)


def torch_style_callbacks(calls: list):
    """FORWARD and FULL_BACKWARD callbacks as written for torch's runtime (after torch's
    own test_custom_function_callback), recording what they ran."""

    def forward(action, ctx: _PipelineContext):
        schedule = ctx.schedule_ref
        assert isinstance(schedule, _PipelineScheduleRuntime)
        local = {stage.stage_index: stage for stage in schedule._stages}
        stage, mb = local[action.stage_index], action.microbatch_index
        if not stage.is_first and stage.stage_index - 1 not in local:
            _wait_batch_p2p(schedule.fwd_recv_ops.pop((stage.stage_index, mb)))
        output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb])
        schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
        if stage.stage_index + 1 in local:
            local[stage.stage_index + 1].set_local_fwd_input(output, mb)
        calls.append(str(action))

    def backward(action, ctx: _PipelineContext):
        schedule = ctx.schedule_ref
        local = {stage.stage_index: stage for stage in schedule._stages}
        stage, mb = local[action.stage_index], action.microbatch_index
        if not stage.is_last and stage.stage_index + 1 not in local:
            _wait_batch_p2p(schedule.bwd_recv_ops.pop((stage.stage_index, mb)))
        schedule._assert_unsharded(stage)
        schedule.backward_counter[stage.stage_index] += 1
        stage.backward_one_chunk(mb, loss=schedule._maybe_get_loss(stage, mb),
                                 full_backward=True, last_backward=False)
        if stage.stage_index - 1 in local:
            local[stage.stage_index - 1].set_local_bwd_input(
                stage.get_local_bwd_output(mb), mb)
        calls.append(str(action))

    return forward, backward
