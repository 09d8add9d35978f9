"""Runs rrfp on torch 2.11, the torch of the lent GPU machine's image, which is outside rrfp's
supported range (2.13-2.15) and cannot be replaced there (a CUDA build of torch is larger
than what may travel to that machine).

Put this folder first on ``PYTHONPATH`` so that every process loads it, and lower the floor
in ``rrfp/_torch_compat.py`` in that copy (benchmarks/results/gpu_check.md gives the
command). It maps the private names of ``torch.distributed.pipelining`` that rrfp uses and
that changed between 2.11 and 2.13, each to what 2.11 has; on torch >= 2.13 it does
nothing. It is a harness for the GPU check, not part of rrfp: only the single-process GPU
check and ``python -m rrfp.demo`` (2 CPU processes) have run through it.
"""

import inspect

import torch


def _map_pipelining_names() -> None:
    import torch.distributed.pipelining._utils as utils
    import torch.distributed.pipelining.schedules as schedules
    import torch.distributed.pipelining.stage as stage

    utils._make_tensor_from_meta = stage._make_tensor_from_meta  # lives in stage.py on 2.11
    stage._DTensorMeta = type("_DTensorMeta", (), {})  # 2.11 sends no DTensor metadata
    # 2.11's receive descriptors hold an example buffer where 2.13's hold metadata.
    stage._RecvInfo.tensor_meta = property(lambda info: info.buffer)
    stage._RecvInfo.is_root_arg = False
    stage._RootArgPlaceholder.is_root_arg = True
    stage._RootArgPlaceholder.tensor_meta = None
    stage._PipelineStageBase._runtime_validate = False  # 2.11 validates no inputs at run time

    initialize = schedules.PipelineScheduleMulti._initialize_stages
    schedules.PipelineScheduleMulti._initialize_stages = (
        lambda self, args, kwargs, target=None, loss_kwargs=None: initialize(self, args, kwargs))
    if len(inspect.signature(schedules._PipelineSchedule._compute_loss).parameters) == 3:
        compute_loss = schedules._PipelineSchedule._compute_loss
        schedules._PipelineSchedule._compute_loss = (
            lambda self, output, target, loss_kwargs=None: compute_loss(self, output, target))

    retrieve = stage._PipelineStageBase._retrieve_recv_activations

    def retrieve_recv_activations(self, fwd_chunk_id):
        # 2.13 sets requires_grad on received activations when it hands them out; 2.11
        # created its own buffers with it, and rrfp binds buffers of its own.
        wants_grad = self.has_backward and torch.is_grad_enabled()
        for info in self.args_recv_info[fwd_chunk_id]:
            buffer = getattr(info, "buffer", None)
            if wants_grad and buffer is not None and buffer.is_leaf and not buffer.requires_grad:
                buffer.requires_grad_(True)
        return retrieve(self, fwd_chunk_id)

    def clear_runtime_states(self) -> None:
        # 2.11's, except that a buffer rrfp unbound (None, which 2.13 allows) is skipped.
        self.fwd_cache.clear()
        self.output_chunks.clear()
        for infos in self.args_recv_info.values():
            for info in infos:
                if isinstance(info, stage._RecvInfo) and info.buffer is not None:
                    info.buffer.grad = None

    stage._PipelineStageBase._retrieve_recv_activations = retrieve_recv_activations
    stage._PipelineStageBase.clear_runtime_states = clear_runtime_states


if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13):
    _map_pipelining_names()
