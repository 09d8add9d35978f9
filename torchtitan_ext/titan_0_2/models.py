"""torchtitan 0.2.2: models and train specs whose per-microbatch work varies with the data.

* ``rrfp_llama3_documents``: torchtitan's llama3, fed one document per sample
  (``torchtitan_ext.common.data``): microbatches differ in sequence length.
* ``rrfp_multimodal``: llama3 whose first stage first runs an image-patch encoder over the
  sample's patches (how many depends on the document), then prepends them to the token
  embeddings: the first stage's work, and every activation's length, vary with the data.
"""

from __future__ import annotations

from torchtitan_ext.common.version import require, TOML_INSTEAD

require((0, 2), "torchtitan_ext.titan_0_2.models", TOML_INSTEAD)

import dataclasses

import torch
from torch import nn
from torchtitan.models.llama3 import llama3_args, Transformer, TransformerModelArgs
from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

from torchtitan_ext.common.data import (
    build_document_dataloader, build_image_document_dataloader, PATCH_DIM)

DOCUMENTS, MULTIMODAL = "rrfp_llama3_documents", "rrfp_multimodal"


@dataclasses.dataclass
class MultimodalArgs(TransformerModelArgs):
    patch_dim: int = PATCH_DIM
    """Features per image patch."""
    encoder_layers: int = 4
    """Residual MLP blocks of the patch encoder (its cost grows with the patches)."""


class PatchEncoder(nn.Module):
    """Patches -> model dimension, then residual MLP blocks, one patch at a time."""

    def __init__(self, args: MultimodalArgs):
        super().__init__()
        self.project = nn.Linear(args.patch_dim, args.dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(args.dim), nn.Linear(args.dim, 4 * args.dim), nn.GELU(),
                          nn.Linear(4 * args.dim, args.dim))
            for _ in range(args.encoder_layers))

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.LayerNorm)):
                module.reset_parameters()

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        h = self.project(patches)
        for block in self.blocks:
            h = h + block(h)
        return h


class MultimodalTransformer(Transformer):
    """llama3 with an image-patch encoder before the language layers (first stage)."""

    def __init__(self, model_args: MultimodalArgs):
        super().__init__(model_args)
        self.patch_encoder = PatchEncoder(model_args)

    def init_weights(self, buffer_device: torch.device | None = None):
        super().init_weights(buffer_device)
        if self.patch_encoder is not None:
            self.patch_encoder.reset_parameters()

    def forward(self, tokens: torch.Tensor, patches: torch.Tensor | None = None,
                patch_counts: torch.Tensor | None = None, attention_masks=None, positions=None):
        """``patches``: [batch, patches, patch_dim], zeros where a sample has fewer;
        ``patch_counts`` (how many are real) is not needed here: torchtitan passes it along
        with the other extra inputs."""
        if self.patch_encoder is None:  # a later pipeline stage: tokens are activations
            return super().forward(tokens, attention_masks, positions)
        h = self.tok_embeddings(tokens)
        if patches is not None:
            h = torch.cat([self.patch_encoder(patches.to(h.dtype)), h], dim=1)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_masks=attention_masks, positions=positions)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def register_models() -> None:
    """Register the two train specs (once per process)."""
    llama3 = get_train_spec("llama3")
    specs = {
        DOCUMENTS: dataclasses.replace(llama3, build_dataloader_fn=build_document_dataloader),
        MULTIMODAL: dataclasses.replace(
            llama3, model_cls=MultimodalTransformer,
            model_args={"debugmodel": MultimodalArgs(**{
                f.name: getattr(llama3_args["debugmodel"], f.name)
                for f in dataclasses.fields(TransformerModelArgs)})},
            build_dataloader_fn=build_image_document_dataloader),
    }
    for name, spec in specs.items():
        try:
            register_train_spec(name, spec)
        except ValueError:  # registered by an earlier import
            pass


def first_stage_modules(model: nn.Module, module_names_per_stage: list[list[str]]) -> list[list[str]]:
    """The patch encoder goes with the first stage."""
    if not hasattr(model, "patch_encoder"):
        return module_names_per_stage
    return [["patch_encoder", *module_names_per_stage[0]], *module_names_per_stage[1:]]
