"""A step's inputs as microbatches: split from the whole batch, or checked as given."""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.pipelining.microbatch import _split_tensor, TensorChunkSpec

Split = Callable[[tuple, dict], tuple[list, list]]
"""The schedule's split of whole-batch positional and keyword inputs into microbatches."""


def microbatch_inputs(split: Split, n_microbatches: int, args: tuple, kwargs: dict, target,
                      arg_mbs, kwarg_mbs, target_mbs) -> tuple[list, list, list | None]:
    """Whole-batch inputs split, or pre-split ones checked, as torch's schedules do."""
    if all(mbs is None for mbs in (arg_mbs, kwarg_mbs, target_mbs)):
        arg_mbs, kwarg_mbs = split(args, kwargs)
        target_mbs = (None if target is None else
                      list(_split_tensor(target, TensorChunkSpec(0), n_microbatches)))
        return arg_mbs, kwarg_mbs, target_mbs
    mixed = [name for name, given in (("positional inputs", args), ("keyword inputs", kwargs),
                                      ("target=", target is not None)) if given]
    if mixed:
        raise ValueError(f"pre-split inputs (arg_mbs/kwarg_mbs/target_mbs) and whole-batch "
                         f"{', '.join(mixed)} were both given: pass each microbatch's "
                         "inputs through arg_mbs=, kwarg_mbs= and target_mbs= only")
    for name, mbs, kind in (("arg_mbs", arg_mbs, tuple), ("kwarg_mbs", kwarg_mbs, dict),
                            ("target_mbs", target_mbs, None)):
        if mbs is None:
            continue
        if not isinstance(mbs, list):
            raise TypeError(f"{name} must be a list, one entry per microbatch, not a "
                            f"{type(mbs).__name__}")
        if len(mbs) != n_microbatches:
            raise ValueError(f"{name} has {len(mbs)} entries for {n_microbatches} "
                             "microbatches")
        wrong = [i for i, mb in enumerate(mbs) if kind is not None and not isinstance(mb, kind)]
        if wrong:
            raise TypeError(f"{name}[{wrong[0]}] is a {type(mbs[wrong[0]]).__name__}, not a "
                            f"{kind.__name__}")
    return (arg_mbs if arg_mbs is not None else [()] * n_microbatches,
            kwarg_mbs if kwarg_mbs is not None else [{}] * n_microbatches,
            target_mbs)
