"""Every difference between the supported torch versions (2.13, 2.14, 2.15), in one place.

rrfp drives private internals of ``torch.distributed.pipelining``. ``RELIED_ON`` lists every
private name of torch it uses, with the call shape it uses and the versions each applies
to; ``check_torch`` checks them once per process (at import and at each ScheduleRRFP's
construction) and names in one line whatever a torch lacks or calls differently
(``rrfp.torch_probe``), so that an untested torch either runs or says why. What changed
between the versions it supports, and how rrfp reads the same on each:

* **Bookkeeping actions.** torch 2.15's ``_add_reduce_grad`` follows every ``REDUCE_GRAD``
  with a ``WAIT_REDUCE_GRAD`` (and its lowering has ``WAIT_SEND_F/B``). rrfp runs a
  stage's reduction synchronously at ``REDUCE_GRAD`` and derives all communication itself,
  so such actions are dropped from hints (``is_bookkeeping``, ``add_reduce_grad``).
* **Receive buffers.** Up to 2.14 a stage allocates one buffer per microbatch at shape
  inference and reads ``info.buffer``; from 2.15 buffers are lazy: ``info.buffer`` stays
  None until a receive is posted, the stage's compute takes it (``take_buffer()`` clears
  it), and a stage re-initialized while a buffer is bound raises. On every version rrfp's
  receive rings own their slots, bind one to a ``_RecvInfo`` when they post its receive
  (``bind_receive``) and unbind what is left at step end or after a failure
  (``unbind_receive``), so nothing stays bound to torch's descriptors between steps.
* **Forward state.** ``stage.fwd_cache`` (<= 2.14) became ``stage._forward_chunk_states``
  (2.15); rrfp reads neither for shapes (its executor records what it sends), only to
  count what a stage holds (``forward_states_held``) and to clear it after a failure.
* **Sent outputs.** 2.15's stages keep a forward output referenced until
  ``release_fwd_send_outputs`` (its schedules call it once the send completed). rrfp's
  transport holds its own reference to every tensor it sends until the send completes, so
  the stage's reference is dropped as soon as the send is handed over
  (``release_sent_outputs``): never later than torch's own schedules let go of it.
* **What a split backward frees at I.** On every version the input-gradient backward (I)
  detaches the stage's outputs it holds, so the autograd nodes between the outputs and
  what W needs (a tanh's or a relu's saved output, say) are freed at I, while what W needs
  stays until W. On 2.15 a stage whose sent output was released backpropagates from the
  output's gradient edge and detaches nothing: an output that something else still keeps
  (saved-tensor hooks that hold what they pack: a relu saves its own output, so the
  output, its node and what that node saved keep each other alive) would then outlive I,
  until W or for good. torch 2.15's own schedules release an output at its send's wait,
  which they place after that microbatch's local backward, so their stage still holds it
  at I and detaches it. rrfp releases it when the send is handed over and keeps only a
  weak reference (``OutputsAtInputBackward``): after I it detaches what is still alive, as
  every version's I does, and never keeps an output alive itself.
* **Gradient finalization.** 2.15's ``step(finalize_gradients=False)`` leaves FSDP
  gradients unreduced and parameters unsharded for accumulation across calls. rrfp
  accepts the argument on every version (it only decides whether ``REDUCE_GRAD`` runs
  FSDP's reduction, which each version's ``perform_reduce_grad`` performs).
* **First-step set-up.** 2.15's ``_initialize_stages`` runs an all-reduce on the pipeline
  group and connects torch's own P2P edges before shape inference; every rank runs it at
  the same point (its first step, before any action), as under torch's schedules, so it
  needs nothing here. rrfp's channels are its own and connect at construction.
* **Gradient reduction.** 2.15's ``perform_reduce_grad`` reduces FSDP gradients through
  ``finalize_backward(async_op=True)`` and waits for it; rrfp calls it at ``REDUCE_GRAD``
  on every version, so the reduction still completes within that action.
* **Input checks.** A stage checks its inputs' shapes and dtypes only at
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (``_runtime_validate``), on every supported version,
  inside its forward; ``check_first_stage_inputs`` runs that check on a first stage's
  microbatches before the step communicates, so a wrong input raises torch's
  ``PipeliningShapeError`` while the schedule can still run further steps.
* **Pre-split microbatches** (``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``)
  exist in torch's schedules from 2.14; ``ScheduleRRFP.step`` implements that contract
  itself, so the call works on 2.13 too.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Sequence

import torch

from rrfp.torch_probe import needed, problems, UnsupportedTorchError

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])  # type: ignore[assignment]
"""(major, minor) of the running torch."""

SUPPORTED = ((2, 13), (2, 16))
"""The supported range: from the first inclusive to the second exclusive."""

_PIPELINING = "torch.distributed.pipelining"
_SCHEDULES, _STAGE = f"{_PIPELINING}.schedules", f"{_PIPELINING}.stage"
_RUNTIME, _BASE = "_PipelineScheduleRuntime", "_PipelineStageBase"

RELIED_ON = (
    *needed(_SCHEDULES, "_Action(3)", "_Action.stage_index", "_Action.computation_type",
            "_Action.microbatch_index", "_Action.is_compute_op", "_Action.from_str(1)",
            *(f"_ComputationType.{kind}" for kind in (
                "FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "REDUCE_GRAD",
                "OVERLAP_F_B", "UNSHARD", "RESHARD")),
            "UNSHARD", "RESHARD", "_add_reduce_grad(2)",
            "_add_send_recv(1, stage_to_rank, num_stages)", "_validate_schedule(4)",
            "_get_profiler_function_name(1)", "_check_torch_compile_compatibility(2)",
            "_PipelineSchedule", "_ScheduleForwardOnly", "_PipelineContext(5)",
            "PipelineScheduleMulti(0, stages, n_microbatches, loss_fn, args_chunk_spec, "
            "kwargs_chunk_spec, output_merge_spec, scale_grads, backward_requires_autograd)",
            "PipelineScheduleMulti._backward_requires_autograd", "PipelineScheduleSingle._stage",
            f"{_RUNTIME}.register_custom_function(2)",
            f"{_RUNTIME}._initialize_stages(4)", f"{_RUNTIME}._check_inputs(4)",
            f"{_RUNTIME}._split_inputs(2)", f"{_RUNTIME}._merge_outputs(1)",
            f"{_RUNTIME}._update_losses(2)", f"{_RUNTIME}._compute_loss(3)",
            *(f"{_RUNTIME}.{attribute}" for attribute in (
                "_stages", "_n_microbatches", "_num_stages", "_internal_losses",
                "_comp_type_to_function_map", "backward_counter", "fwd_recv_ops",
                "bwd_recv_ops", "_has_backward", "_loss_fn", "pp_group_size", "rank"))),
    *needed(_SCHEDULES, "_ComputationType.WAIT_REDUCE_GRAD", since=(2, 15)),
    *needed(_STAGE, f"{_BASE}.forward_one_chunk(3, save_forward_output)",
            f"{_BASE}.backward_one_chunk(1, loss, full_backward, last_backward)",
            f"{_BASE}.backward_weight_one_chunk(1, last_backward)",
            f"{_BASE}.get_fwd_send_ops(1)", f"{_BASE}.get_bwd_send_ops(1)",
            f"{_BASE}.set_local_fwd_input(2)", f"{_BASE}.set_local_bwd_input(2)",
            f"{_BASE}.get_local_bwd_output(1)", f"{_BASE}.perform_reduce_grad(1)",
            f"{_BASE}.clear_runtime_states(0)", f"{_BASE}._validate_stage_tensors(3)",
            *(f"{_BASE}.{attribute}" for attribute in (
                "args_recv_info", "grad_recv_info", "backward_state", "dw_runner", "bwd_cache",
                "_runtime_validate", "_stage_meta", "output_chunks", "has_backward", "group",
                "group_size", "stage_index", "num_stages", "device", "submod", "is_first",
                "is_last", "stage_index_to_group_rank")),
            "_RecvInfo.buffer", "_RecvInfo.tensor_meta", "_RecvInfo.is_root_arg",
            "_DTensorMeta"),
    *needed(_STAGE, f"{_BASE}.fwd_cache", until=(2, 15)),
    *needed(_STAGE, f"{_BASE}._forward_chunk_states", f"{_BASE}.release_fwd_send_outputs(1)",
            since=(2, 15)),
    *needed(f"{_PIPELINING}._utils", "_make_tensor_from_meta(2)",
            "generate_stage_to_rank_mapping(2, style)"),
    *needed(f"{_PIPELINING}.microbatch", "_split_tensor(3)"),
    *needed("torch.distributed.distributed_c10d", "_get_default_group(0)",
            "_get_default_store(0)", "ProcessGroup._get_backend",
            "ProcessGroup._set_default_backend", "ProcessGroup._register_backend", "ProcessGroup._set_group_name",
            "ProcessGroupGloo._Options._timeout", "ProcessGroupGloo._Options._devices",
            "ProcessGroupGloo.options"),
    *needed("torch._utils", "_flatten_dense_tensors(1)", "_unflatten_dense_tensors(2)"),
    *needed("torch.autograd.profiler", "_is_profiler_enabled"),
    *needed("torch.utils._python_dispatch", "is_traceable_wrapper_subclass(1)"),
)
"""Every private name of torch rrfp drives (and the call shape rrfp uses), in the torch
versions it applies to: ``check_torch`` checks them all."""


def supported_range() -> str:
    """The supported torch versions, as ``"2.13-2.15"``."""
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED
    highest = f"{high_major}.{high_minor - 1}" if high_minor else f"below {high_major}.0"
    return f"{low_major}.{low_minor}-{highest}"


def _install_line() -> str:
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED
    return f"pip install 'torch>={low_major}.{low_minor},<{high_major}.{high_minor}'"


def check_supported() -> None:
    """Refuse a torch older than the range, warn about a newer one (rrfp drives private
    internals of torch.distributed.pipelining, which change between releases;
    ``check_torch`` says whether the ones rrfp drives are still there)."""
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED
    if TORCH_VERSION < SUPPORTED[0]:
        raise ImportError(f"rrfp needs torch >= {low_major}.{low_minor}, found "
                          f"{torch.__version__}: {_install_line()}")
    if TORCH_VERSION >= SUPPORTED[1]:
        warnings.warn(f"rrfp is tested with torch < {high_major}.{high_minor}, found "
                      f"{torch.__version__}: if pipelining fails, {_install_line()}",
                      stacklevel=2)


@functools.cache
def check_torch() -> None:
    """Raise ``UnsupportedTorchError`` naming, in one line, every name of ``RELIED_ON``
    that the running torch lacks or calls differently: an untested torch either runs or
    says why (once per process; at import, and at each ScheduleRRFP's construction)."""
    found = problems(RELIED_ON, TORCH_VERSION)
    if found:
        raise UnsupportedTorchError(
            f"rrfp needs {'; '.join(found)} (torch {torch.__version__}); supported torch: "
            f"{supported_range()}: {_install_line()}")


# At import, before the private imports below: a torch out of the range, and a name torch
# lacks, are each refused in one line, never by an error from deep inside rrfp.
check_supported()
check_torch()

from torch.distributed.pipelining.schedules import (  # noqa: E402
    _Action, _add_reduce_grad, _ComputationType)
from torch.distributed.pipelining.stage import _PipelineStageBase  # noqa: E402

REDUCTION_WAITS = frozenset(
    _ComputationType[name] for name in ("WAIT_REDUCE_GRAD",) if name in _ComputationType.__members__)
"""The actions that wait for a gradient reduction (2.15's ``WAIT_REDUCE_GRAD``)."""


def is_bookkeeping(action: _Action) -> bool:
    """Whether ``action`` is a gradient-reduction action torch adds to compute orders
    (``REDUCE_GRAD``, and 2.15's ``WAIT_REDUCE_GRAD``), which rrfp re-derives itself."""
    return action.computation_type == _ComputationType.REDUCE_GRAD or (
        action.computation_type in REDUCTION_WAITS)


def add_reduce_grad(actions: list[_Action], n_microbatches: int) -> list[_Action]:
    """torch's placement of ``REDUCE_GRAD`` after each stage's last backward piece,
    without the waits 2.15 adds (rrfp's reduction completes within the action)."""
    placed = _add_reduce_grad(list(actions), n_microbatches)  # type: ignore[arg-type]
    return [a for a in placed if a is not None and a.computation_type not in REDUCTION_WAITS]


def bind_receive(info, buffer: torch.Tensor) -> None:
    """Make ``buffer`` the one the stage reads ``info``'s input or gradient from."""
    info.buffer = buffer


def unbind_receive(info) -> None:
    """Leave ``info`` without a buffer (2.15 refuses to re-initialize a stage otherwise)."""
    info.buffer = None


def forward_states_held(stage: _PipelineStageBase) -> int:
    """Microbatches whose forward state (inputs and outputs for backward) the stage holds."""
    states = getattr(stage, "_forward_chunk_states", None)
    return len(states if states is not None else stage.fwd_cache)


def release_sent_outputs(stage: _PipelineStageBase, microbatch: int) -> None:
    """Drop the stage's references to ``microbatch``'s outputs, whose sends the transport
    now holds (2.15; earlier stages hold outputs until backward, as their schedules do)."""
    release = getattr(stage, "release_fwd_send_outputs", None)
    if release is not None:
        release(microbatch)


class OutputsAtInputBackward:
    """The stages' forward outputs, held weakly from their forward until their microbatch's
    input-gradient backward (I), which detaches those still alive (see "What a split
    backward frees at I" above): the stage's own I does so only for outputs it still
    holds, which on 2.15 excludes the sent ones rrfp released."""

    def __init__(self) -> None:
        self._outputs: dict[tuple[int, int], list[weakref.ref]] = {}

    def forwarded(self, stage_index: int, microbatch: int, output) -> None:
        """Remember ``output`` (a tensor or a sequence of them) of a forward, weakly."""
        outputs = output if isinstance(output, Sequence) else (output,)
        self._outputs[stage_index, microbatch] = [
            weakref.ref(t) for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def backward_done(self, stage: _PipelineStageBase, microbatch: int, full: bool) -> None:
        """After a backward of ``microbatch`` on ``stage``: an I detaches the outputs still
        alive, where the stage's own I does (not on a first stage: its I computes nothing,
        and its W backpropagates from the outputs; a full B frees the graph it ran
        through)."""
        detach = not full and not stage.is_first
        for ref in self._outputs.pop((stage.stage_index, microbatch), ()):
            output = ref()
            if detach and output is not None and not output._is_view():
                output.detach_()  # views cannot (torch's last stage skips them too)


def clear_after_failure(stage: _PipelineStageBase) -> None:
    """Let go of everything a failed step left in the stage: forward states, outputs,
    what a split backward keeps from I to W (torch's own clearing leaves that), and inputs
    handed over by a local stage but never consumed."""
    stage.clear_runtime_states()
    for held in (stage.backward_state, stage.dw_runner, stage.bwd_cache):
        held.clear()
    for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
        for info in infos:
            if not info.is_root_arg:
                unbind_receive(info)


def check_first_stage_inputs(stage: _PipelineStageBase, arg_mbs: list[tuple]) -> None:
    """Raise torch's ``PipeliningShapeError`` for the first microbatch whose inputs the first
    stage ``stage`` would refuse in its forward (only where it checks them: at
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``), with the stage's own message."""
    if not stage._runtime_validate:
        return
    for args in arg_mbs:
        stage._validate_stage_tensors(f"Stage {stage.stage_index} forward inputs",
                                      stage._stage_meta.inputs, args)
