"""The batch settings a torchtitan job's pipeline reads, under each torchtitan's names.

torchtitan 0.2.2 and 0.3 count samples: ``training.local_batch_size`` samples per
data-parallel rank and step, split into microbatches of
``parallelism.pipeline_parallel_microbatch_size`` samples, each ``training.seq_len`` tokens
long. torchtitan's main branch (pytorch/torchtitan#4121, "fold batch dim") counts tokens
and names the microbatches themselves: ``training.num_tokens_per_microbatch_per_dp_rank``
tokens per microbatch, ``parallelism.num_pp_microbatches`` microbatches per step,
``training.max_context_length`` for the longest context (``training.global_batch_size``
became ``training.num_tokens_per_train_step``, which rrfp does not read). ``batch_settings``
reads either set, so the rest of ``torchtitan_ext`` reads one.
"""

from __future__ import annotations

from dataclasses import dataclass

TOKEN_BATCH_FIELD = "num_tokens_per_microbatch_per_dp_rank"
"""The training field whose presence says the config uses torchtitan main's names."""


@dataclass(frozen=True)
class BatchSettings:
    microbatches: int
    """Pipeline microbatches per step."""
    context_length: int
    """Tokens of the longest sample (``training.seq_len``; main: ``max_context_length``)."""
    local_batch_size: int | None
    """Samples per data-parallel rank and step; None under main's names (it counts tokens)."""
    source: str
    """Where ``microbatches`` comes from, in the config's own names and values."""
    remedy: str
    """How to get more microbatches, in those names."""


def batch_settings(training, parallelism) -> BatchSettings:
    """The batch settings of a job's ``training`` and ``parallelism`` configs, under
    torchtitan 0.2.2's and 0.3's names or main's; ValueError where a batch does not split
    into whole microbatches, or main's count of them is not a whole number >= 1."""
    if hasattr(training, TOKEN_BATCH_FIELD):
        count = parallelism.num_pp_microbatches
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"parallelism.num_pp_microbatches must be a whole number >= 1 "
                             f"(the pipeline's microbatches per step), got {count!r}")
        return BatchSettings(count, training.max_context_length, None,
                             f"parallelism.num_pp_microbatches ({count})", "raise it")
    batch = training.local_batch_size
    microbatch = parallelism.pipeline_parallel_microbatch_size
    if batch % microbatch != 0:
        raise ValueError(
            f"training.local_batch_size={batch} must be a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size={microbatch}")
    return BatchSettings(batch // microbatch, training.seq_len, batch,
                         f"training.local_batch_size ({batch}) / "
                         f"parallelism.pipeline_parallel_microbatch_size ({microbatch})",
                         "raise the first or lower the second")
