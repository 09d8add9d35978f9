"""torchtitan 0.3: ``rrfp_multimodal``, llama3 whose first stage first encodes image patches.

The model of ``torchtitan_ext.titan_0_2.models``' ``rrfp_multimodal`` (torchtitan 0.2.2) in torchtitan
0.3's terms: a ``Llama3Model`` with a ``vision_encoder`` (a patch encoder: patches -> model
dimension, then residual MLP blocks), whose output is prepended to the token embeddings.
How many patches a sample has depends on its document (``torchtitan_ext.common.data``): the first
stage's work, and every activation's length, vary with the data. Its ``pipelining_fn`` is
torchtitan's ``pipeline_vlm``, which puts the vision encoder on the first stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan_ext.common.version import CONFIG_FN_INSTEAD, require

require((0, 3), "torchtitan_ext.titan_0_3.multimodal", CONFIG_FN_INSTEAD)

import torch  # noqa: E402
from torchtitan.distributed.pipeline_parallel import pipeline_vlm  # noqa: E402
from torchtitan.models.common import GELU, LayerNorm, Linear  # noqa: E402
from torchtitan.models.llama3 import Llama3Model, model_registry  # noqa: E402
from torchtitan.protocols.model_spec import ModelSpec  # noqa: E402
from torchtitan.protocols.module import Module, ModuleList, Sequential  # noqa: E402

from torchtitan_ext.common.data import PATCH_DIM  # noqa: E402

MULTIMODAL = "rrfp_multimodal"


class PatchEncoder(Module):
    """Patches -> model dimension, then residual MLP blocks, one patch at a time."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        """Model dimension (of the token embeddings the patches are put before)."""

        patch_dim: int = PATCH_DIM
        """Features per image patch."""

        layers: int = 4
        """Residual MLP blocks (the encoder's cost grows with the patches)."""

    def __init__(self, config: Config):
        super().__init__()
        dim = config.dim
        self.project = Linear.Config(in_features=config.patch_dim, out_features=dim,
                                     bias=True).build()
        self.blocks = ModuleList(
            Sequential(LayerNorm.Config(normalized_shape=dim).build(),
                       Linear.Config(in_features=dim, out_features=4 * dim, bias=True).build(),
                       GELU.Config().build(),
                       Linear.Config(in_features=4 * dim, out_features=dim, bias=True).build())
            for _ in range(config.layers))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        h = self.project(patches)
        for block in self.blocks:
            h = h + block(h)
        return h


class MultimodalLlama3(Llama3Model):
    """llama3 with an image-patch encoder before the language layers (first stage)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Llama3Model.Config):
        vision_encoder: PatchEncoder.Config
        """The patch encoder."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.vision_encoder = config.vision_encoder.build()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                attention_masks=None, patches: torch.Tensor | None = None,
                patch_counts: torch.Tensor | None = None):
        """``patches``: [batch, patches, patch_dim], zeros where a sample has fewer;
        ``patch_counts`` (how many are real) is not needed here: torchtitan passes it
        along with the other extra inputs, to every stage."""
        if self.tok_embeddings is None:  # a later pipeline stage: tokens are activations
            return super().forward(tokens, positions, attention_masks)
        h = self.tok_embeddings(tokens)
        if patches is not None and self.vision_encoder is not None:
            h = torch.cat([self.vision_encoder(patches.to(h.dtype)), h], dim=1)
        for layer in self.layers.values():
            h = layer(h, attention_masks, positions)
        h = self.norm(h) if self.norm is not None else h
        if self._skip_lm_head:
            return h
        return self.lm_head(h) if self.lm_head is not None else h


def multimodal_registry(flavor: str = "debugmodel") -> ModelSpec:
    """torchtitan's llama3 ``flavor`` with the patch encoder, pipelined by ``pipeline_vlm``."""
    llama3 = model_registry(flavor)
    base = llama3.model
    config = MultimodalLlama3.Config(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(Llama3Model.Config)
           if f.init},
        vision_encoder=PatchEncoder.Config(dim=base.dim))
    return dataclasses.replace(llama3, name=MULTIMODAL, model=config, pipelining_fn=pipeline_vlm)
