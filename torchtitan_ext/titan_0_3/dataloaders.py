"""torchtitan 0.3: the data paths of ``torchtitan_ext.common.data`` as torchtitan dataloaders.

``DocumentDataLoader.Config()`` (``dataloader=`` of a ``Trainer.Config``): one document
per sample, padded to ``training.seq_len``; ``images=True``: with the document's image
patches, the text ``MAX_PATCHES`` shorter so that patches and text fit ``seq_len``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_ext.common.version import CONFIG_FN_INSTEAD, require

require((0, 3), "torchtitan_ext.titan_0_3.dataloaders", CONFIG_FN_INSTEAD)

from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402

from torchtitan_ext.common.data import DocumentDataset, MAX_PATCHES  # noqa: E402


class DocumentDataLoader(ParallelAwareDataloader):
    """Whole documents of the generated corpus, one per sample (not packed)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        images: bool = False
        """With each document's image patches (``patches``, ``patch_counts`` inputs) for the
        ``rrfp_multimodal`` model; the text is then ``MAX_PATCHES`` tokens shorter."""

        infinite: bool = True
        """Loop over the corpus without end."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer,
                 seq_len: int, local_batch_size: int, **kwargs):
        text_len = seq_len - (MAX_PATCHES if config.images else 0)
        dataset = DocumentDataset(tokenizer, text_len, dp_rank, dp_world_size, config.images,
                                  config.infinite)
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                         batch_size=local_batch_size)
