"""Data-parallel replicas of a pipeline's stages (DDP, FSDP2), kept in lockstep.

Replicas of a stage interleave its actions differently under RRFP, so nothing may talk to
the data-parallel group at a timing-dependent point (docs/design/invariants.md, 4):

* **FSDP**: every FSDP module of the rank's stages is unsharded at the step's start, in
  stage order, and stays unsharded for the whole step (its pre-forward and pre-backward
  hooks would all-gather); ``REDUCE_GRAD``, which the hint places after each stage's last
  backward piece and the arbiter runs in the hint's fixed stage order, reduces and
  reshards. A stage holding FSDP modules must be one itself (its root reduces them).
* **DDP**: compute runs on the wrapped module (DDP talks to its group from inside forward
  and backward), and ``REDUCE_GRAD`` all-reduces the gradients in buckets, as DDP's
  default hook does.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)


class DataParallel:
    """The data-parallel wrappers of one rank's stages: checked and unwrapped once (at
    construction), unsharded at each step's start, reduced at each stage's REDUCE_GRAD."""

    def __init__(self, stages: list[_PipelineStageBase]):
        _check_fsdp_wraps_the_stage(stages)
        _warn_about_shared_parameters(stages)
        self._stages = sorted(stages, key=lambda s: s.stage_index)
        self._ddp = _unwrap_ddp(stages)

    @property
    def uses_fsdp(self) -> bool:
        """Whether any of the stages holds FSDP modules."""
        return any(isinstance(m, FSDPModule) for stage in self._stages
                   for m in stage.submod.modules())

    def groups(self) -> list[dist.ProcessGroup]:
        """The DDP wrappers' groups (FSDP's are its sharded parameters' meshes)."""
        return [ddp.process_group for ddp in self._ddp.values()]

    def unshard(self) -> list[FSDPModule]:
        """Unshard the stages' FSDP modules now, in stage order, for the whole step;
        return them."""
        fsdp_modules = []
        for stage in self._stages:
            stage_modules = [m for m in stage.submod.modules() if isinstance(m, FSDPModule)]
            for module in stage_modules:
                module.set_reshard_after_forward(False, recurse=False)
            fsdp_modules.extend(stage_modules)
        handles = [module.unshard(async_op=True) for module in fsdp_modules]
        for handle in handles:
            if handle is not None:
                handle.wait()
        return fsdp_modules

    def reduce(self, stage: _PipelineStageBase, *, finalize: bool, divide_by: int) -> None:
        """``stage``'s REDUCE_GRAD: DDP's all-reduce, then torch's own reduction of the
        stage (FSDP's reduce-scatter and reshard; gradient scaling by ``divide_by``).
        ``finalize=False`` (torch 2.15's ``finalize_gradients``) leaves an FSDP stage's
        gradients unreduced and its parameters unsharded, to accumulate over more calls."""
        if stage.stage_index in self._ddp:
            _all_reduce_gradients(self._ddp[stage.stage_index])
        if finalize or not isinstance(stage.submod, FSDPModule):
            stage.perform_reduce_grad(divide_by)


def _unwrap_ddp(stages: list[_PipelineStageBase]) -> dict[int, DistributedDataParallel]:
    """Run DDP-wrapped stages on the wrapped module; return the wrappers by stage.

    DDP talks to its group from inside forward (bucket rebuild, buffer broadcast) and
    backward (gradient all-reduce), at points whose timing differs between replicas under
    RRFP. So RRFP computes on ``ddp.module`` and reduces the gradients itself at
    REDUCE_GRAD, in fixed stage order, as DDP's default hook does.
    """
    wrappers = {}
    for stage in stages:
        if isinstance(stage.submod, DistributedDataParallel):
            ddp = stage.submod
            if ddp.broadcast_buffers and any(True for _ in ddp.module.buffers()):
                raise ValueError(
                    f"stage {stage.stage_index} is wrapped in DDP with broadcast_buffers="
                    "True and has buffers, which DDP broadcasts in every forward: under "
                    "RRFP replicas run forwards at different times; construct "
                    "DistributedDataParallel(..., broadcast_buffers=False) or use FSDP")
            # DDP keeps hooks registered with register_comm_hook in this list; RRFP
            # reduces the gradients itself and could not run them.
            if ddp._comm_hooks:
                raise ValueError(
                    f"stage {stage.stage_index} is wrapped in DDP with a communication "
                    "hook, which RRFP cannot run: it reduces DDP gradients itself, at "
                    "REDUCE_GRAD in fixed stage order (DDP's default: average over "
                    "replicas); remove the hook, or use FSDP")
            wrappers[stage.stage_index] = ddp
            stage.submod = ddp.module
    return wrappers


def _all_reduce_gradients(module: DistributedDataParallel) -> None:
    """What DDP's default hook does (divide by the replica count, then sum), bucket by
    bucket of at most DDP's ``bucket_bytes_cap``: the extra memory is one bucket."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # unused here, maybe used on another replica: sizes must match
            p.grad = torch.zeros_like(p)
    group = module.process_group
    replicas = dist.get_world_size(group)
    for bucket in gradient_buckets([p.grad for p in params], module.bucket_bytes_cap):
        flat = torch._utils._flatten_dense_tensors(bucket)
        flat.div_(replicas)
        dist.all_reduce(flat, group=group)
        for grad, reduced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
            grad.copy_(reduced)


def gradient_buckets(grads: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients in buckets of at most ``cap_bytes`` (a larger gradient alone),
    in parameter order: the same buckets on every replica."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if not buckets or size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += nbytes
    return buckets


def _check_fsdp_wraps_the_stage(stages: list[_PipelineStageBase]) -> None:
    """FSDP modules inside a stage need the stage module itself to be one.

    RRFP reduces and reshards a stage's FSDP modules at its REDUCE_GRAD through the stage
    module (as torch's stages do); inner FSDP modules under a plain root would
    reduce-scatter inside every backward, at points whose timing differs between
    replicas: mismatched collectives.
    """
    for stage in stages:
        if not isinstance(stage.submod, FSDPModule) and any(
                isinstance(m, FSDPModule) for m in stage.submod.modules()):
            raise ValueError(
                f"stage {stage.stage_index} holds FSDP modules but is not one itself: apply "
                "fully_shard to the stage module too (after its blocks, as torchtitan does), "
                "so that its gradients are reduced once, at REDUCE_GRAD")


def _warn_about_shared_parameters(stages: list[_PipelineStageBase]) -> None:
    """Parameters shared by two stages of this rank (tied embeddings under V placement)
    accumulate gradients from both, in an order that depends on timing under RRFP."""
    owner: dict[int, int] = {}
    for stage in stages:
        for p in stage.submod.parameters():
            first = owner.setdefault(id(p), stage.stage_index)
            if first != stage.stage_index:
                message = (
                    f"stages {first} and {stage.stage_index} on this rank share parameters: "
                    "their gradient contributions add up in an order that depends on "
                    "timing, so gradients are not bitwise those of the fixed schedule "
                    "(still correct up to floating-point rounding)")
                warnings.warn(message, stacklevel=4)
                logger.warning(message)
                return
