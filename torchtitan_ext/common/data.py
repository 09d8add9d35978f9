"""Data whose microbatches differ in shape, and how to cut a batch into such microbatches.

Two data paths, both generated from the arithmetic corpus (nothing is downloaded):

* **documents** (``model.name = "rrfp_llama3_documents"``): one document per sample, not
  packed: samples differ in length, padded to ``seq_len`` in the batch with labels
  ``IGNORE_INDEX`` (ignored by the loss, which torchtitan normalizes per valid token);
* **documents with images** (``model.name = "rrfp_multimodal"``): the same, plus a
  per-sample number of image patches taken from the document itself (4 per "times"
  equation, 0-40), which the first stage encodes before the language layers.

``split_by_content`` cuts a batch into microbatches each as long as its own content
(rounded up to a multiple of 16): the longest document of the microbatch, plus its most
patches. ``pad_to=(tokens, patches)`` gives what users of fixed-shape pipelines do today:
every microbatch padded to one shape for the whole run (torch's stages fix their shapes at
the first step).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX

from rrfp.core.sizes import MicrobatchSize

from torchtitan_ext.common.assets import arithmetic_corpus
from torchtitan_ext.common.batch import batch_settings

PATCHES_PER_IMAGE = 4
MAX_PATCHES = 40
PATCH_DIM = 48
LENGTH_MULTIPLE = 16


def image_patches(document: str) -> torch.Tensor:
    """The document's image patches: 4 per "times" equation, features seeded by its text."""
    count = min(MAX_PATCHES, PATCHES_PER_IMAGE * document.count("times"))
    seed = int.from_bytes(hashlib.sha256(document.encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, PATCH_DIM, generator=generator)


class DocumentDataset(IterableDataset, Stateful):
    """One document per sample, padded to ``text_len`` tokens (labels: ``IGNORE_INDEX``);
    with ``images``, also its patches padded to ``MAX_PATCHES`` and their count."""

    def __init__(self, tokenizer, text_len: int, dp_rank: int, dp_world_size: int,
                 images: bool, infinite: bool = True):
        self._documents = arithmetic_corpus()[dp_rank::dp_world_size]
        self._tokenizer = tokenizer
        self._text_len = text_len
        self._images = images
        self._infinite = infinite
        self._pad = tokenizer.eos_id
        self._index = 0

    def __iter__(self):
        while True:
            while self._index < len(self._documents):
                document = self._documents[self._index]
                self._index += 1
                yield self._sample(document)
            if not self._infinite:
                return
            self._index = 0

    def _sample(self, document: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        tokens = self._tokenizer.encode(document, add_bos=True, add_eos=True)
        tokens = tokens[:self._text_len + 1]
        content = len(tokens) - 1
        inputs = torch.full((self._text_len,), self._pad, dtype=torch.long)
        labels = torch.full((self._text_len,), IGNORE_INDEX, dtype=torch.long)
        inputs[:content] = torch.tensor(tokens[:-1])
        labels[:content] = torch.tensor(tokens[1:])
        sample = {"input": inputs}
        if self._images:
            patches = image_patches(document)
            sample["patches"] = torch.zeros(MAX_PATCHES, PATCH_DIM)
            sample["patches"][:len(patches)] = patches
            sample["patch_counts"] = torch.tensor(len(patches))
        return sample, labels

    def state_dict(self) -> dict[str, Any]:
        return {"index": self._index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._index = state_dict["index"]


def _dataloader(images: bool):
    def build(dp_world_size: int, dp_rank: int, tokenizer, job_config, infinite: bool = True):
        batch = batch_settings(job_config.training, job_config.parallelism)
        if batch.local_batch_size is None:
            raise ValueError("rrfp's document dataloader builds batches of samples "
                             "(training.local_batch_size); this config counts tokens "
                             "(torchtitan main's training.num_tokens_per_microbatch_per_dp_rank)")
        text_len = batch.context_length - (MAX_PATCHES if images else 0)
        dataset = DocumentDataset(tokenizer, text_len, dp_rank, dp_world_size, images, infinite)
        return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                       batch_size=batch.local_batch_size)
    return build


build_document_dataloader = _dataloader(images=False)
build_image_document_dataloader = _dataloader(images=True)


@dataclass
class Microbatches:
    """A batch cut into microbatches: inputs of the first stage, targets of the last."""

    args: list[tuple[torch.Tensor, ...]]
    kwargs: list[dict[str, torch.Tensor]]
    targets: list[torch.Tensor]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in self.targets]

    @property
    def sizes(self) -> list[MicrobatchSize]:
        """What each microbatch's cost follows from (``ScheduleRRFP.step(mb_sizes=...)``)."""
        return [content_size(target, kwargs) for target, kwargs in zip(self.targets, self.kwargs)]


def content_size(target: torch.Tensor, kwargs: dict[str, torch.Tensor]) -> MicrobatchSize:
    """A cut microbatch's size: its positions (image patches included, which enter the
    language stages as tokens), the sum over its rows of their length squared (causal
    attention over each row as cut), and its image patches (``images``: what an encoder
    over them costs)."""
    rows, length = target.shape
    patches = kwargs["patches"].shape[1] if "patches" in kwargs else 0
    return MicrobatchSize(tokens=rows * length, attention=rows * length ** 2,
                          images=rows * patches)


def split_by_content(inputs: torch.Tensor, labels: torch.Tensor,
                     extra_inputs: dict[str, torch.Tensor], n_microbatches: int, *,
                     pad_to: tuple[int, int] | None = None) -> Microbatches:
    """Cut a padded batch into ``n_microbatches``, each as long as its own content rounded
    up to ``LENGTH_MULTIPLE`` (``pad_to=(tokens, patches)``: every microbatch that long,
    with that many patches). Image patches (``extra_inputs["patches"]``,
    ``["patch_counts"]``) come first in the sequence: a microbatch takes as many as its
    sample with the most, and its targets start with that many ``IGNORE_INDEX``."""
    rows = inputs.shape[0]
    if rows % n_microbatches:
        raise ValueError(f"a batch of {rows} samples does not split into {n_microbatches} "
                         "microbatches")
    size = rows // n_microbatches
    valid = labels != IGNORE_INDEX
    positions = torch.arange(labels.shape[1]).expand_as(labels)
    text_lengths = torch.where(valid, positions + 1, 0).amax(dim=1)
    counts = extra_inputs.get("patch_counts")
    parts = [slice(i * size, (i + 1) * size) for i in range(n_microbatches)]

    def round_up(length: int) -> int:
        return min(labels.shape[1], LENGTH_MULTIPLE * math.ceil(max(length, 1) / LENGTH_MULTIPLE))

    text = [round_up(int(text_lengths[part].max())) for part in parts]
    patches = [int(counts[part].max()) if counts is not None else 0 for part in parts]
    if pad_to is not None:
        if pad_to[0] < max(text) or pad_to[1] < max(patches) or pad_to[0] > labels.shape[1]:
            raise ValueError(f"pad_to={pad_to}: the batch needs at least ({max(text)}, "
                             f"{max(patches)}) and has room for {labels.shape[1]} tokens")
        text, patches = [pad_to[0]] * n_microbatches, [pad_to[1]] * n_microbatches
    microbatches = Microbatches([], [], [])
    for part, length, count in zip(parts, text, patches):
        microbatches.args.append((inputs[part, :length],))
        target = labels[part, :length]
        if counts is not None:
            microbatches.kwargs.append({"patches": extra_inputs["patches"][part, :count]})
            target = torch.cat([torch.full((size, count), IGNORE_INDEX, dtype=target.dtype,
                                           device=target.device), target], dim=1)
        else:
            microbatches.kwargs.append({})
        microbatches.targets.append(target)
    return microbatches
