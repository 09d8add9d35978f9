"""``torchtitan_ext.common.batch.batch_settings`` on configs shaped like each torchtitan's:
0.2.2's and 0.3's (samples: ``local_batch_size`` split by ``pipeline_parallel_microbatch_size``)
and main's after pytorch/torchtitan#4121 (tokens: ``num_pp_microbatches`` microbatches of
``num_tokens_per_microbatch_per_dp_rank`` tokens). The fakes carry only each version's own
fields (slotted, as torchtitan's dataclasses are), so a read of another version's name
fails."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from torchtitan_ext.common.batch import batch_settings


@dataclass(slots=True)
class SampleTraining:  # torchtitan 0.2.2's job_config.training, 0.3's TrainingConfig
    local_batch_size: int = 8
    global_batch_size: int = -1
    seq_len: int = 2048


@dataclass(slots=True)
class SampleParallelism:
    pipeline_parallel_microbatch_size: int = 1


@dataclass(slots=True)
class TokenTraining:  # torchtitan main's TrainingConfig
    num_tokens_per_microbatch_per_dp_rank: int = 16384
    num_tokens_per_train_step: int = -1
    max_context_length: int = 2048


@dataclass(slots=True)
class TokenParallelism:
    num_pp_microbatches: int = 1


def test_samples_split_by_the_microbatch_size():
    batch = batch_settings(SampleTraining(local_batch_size=8, seq_len=128),
                           SampleParallelism(pipeline_parallel_microbatch_size=2))
    assert (batch.microbatches, batch.context_length, batch.local_batch_size) == (4, 128, 8)
    assert batch.source == ("training.local_batch_size (8) / "
                            "parallelism.pipeline_parallel_microbatch_size (2)")
    with pytest.raises(ValueError, match=r"training.local_batch_size=6 must be a multiple of "
                                         r"parallelism.pipeline_parallel_microbatch_size=4"):
        batch_settings(SampleTraining(local_batch_size=6), SampleParallelism(4))


def test_torchtitan_mains_names_give_the_microbatches_themselves():
    batch = batch_settings(TokenTraining(num_tokens_per_microbatch_per_dp_rank=4096,
                                         max_context_length=512),
                           TokenParallelism(num_pp_microbatches=8))
    assert (batch.microbatches, batch.context_length, batch.local_batch_size) == (8, 512, None)
    assert (batch.source, batch.remedy) == ("parallelism.num_pp_microbatches (8)", "raise it")


@pytest.mark.parametrize("count", [0, -1, None, 2.0])
def test_a_count_of_microbatches_that_is_not_a_whole_number_above_zero_is_refused(count):
    with pytest.raises(ValueError, match=r"parallelism.num_pp_microbatches must be a whole "
                                         rf"number >= 1 \(the pipeline's microbatches per "
                                         rf"step\), got {count!r}"):
        batch_settings(TokenTraining(), TokenParallelism(num_pp_microbatches=count))
