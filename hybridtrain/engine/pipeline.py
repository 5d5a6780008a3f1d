"""The model as DeepSpeed pipeline layers (pp > 1) or as one sequential module (pp = 1)."""
from __future__ import annotations

import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from hybridtrain.models.build import ModelBuilder
from hybridtrain.models.stages import (DecoderBlock, FinalNorm, LMHead, PositionEmbedding, SequentialLM,
                                       TokenEmbedding, tied_head)
from hybridtrain.parallel.context import TPContext


class HybridPipelineModule(PipelineModule):
    """``PipelineModule`` with the plan's stage boundaries and the grid's TP group published.

    DeepSpeed creates its process groups (``PipelineParallelGrid``) before partitioning and builds
    the local ``LayerSpec``s after, so ``_partition_layers`` is the one point where the TP group
    exists and no layer has been built yet.
    """

    def __init__(self, *, tp: TPContext, stage_bounds: list[int], **kwargs):
        self._hybrid_tp = tp
        self._hybrid_bounds = list(stage_bounds)
        super().__init__(**kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        self._hybrid_tp.bind_grid(self._grid)
        assert len(self._hybrid_bounds) == self.num_stages + 1
        assert self._hybrid_bounds[-1] == len(self._layer_specs), "plan and layer list disagree"
        self.parts = self._hybrid_bounds
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def layer_specs(builder: ModelBuilder) -> list:
    """Pipeline layers in the plan's order: embed, [pos_embed], blocks, final_norm, head.

    A tied head is a ``TiedLayerSpec`` of the embedding: first and last stage each build it, their
    gradients are summed after every step and the weight is kept identical.
    """
    embed = (TiedLayerSpec("embed", TokenEmbedding, builder, tied_weight_attr="weight")
             if builder.tied else LayerSpec(TokenEmbedding, builder))
    specs = [embed]
    if builder.family.position_embed:
        specs.append(LayerSpec(PositionEmbedding, builder))
    specs += [LayerSpec(DecoderBlock, builder, i) for i in range(builder.hf_config.num_hidden_layers)]
    specs.append(LayerSpec(FinalNorm, builder))
    specs.append(TiedLayerSpec("embed", TokenEmbedding, builder, forward_fn=tied_head, tied_weight_attr="weight")
                 if builder.tied else LayerSpec(LMHead, builder))
    return specs


def sequential_model(builder: ModelBuilder, loss_fn) -> nn.Module:
    """All layers in this process (pp = 1); a tied head reuses the embedding module."""
    layers: list[nn.Module] = [TokenEmbedding(builder)]
    if builder.family.position_embed:
        layers.append(PositionEmbedding(builder))
    layers += [DecoderBlock(builder, i) for i in range(builder.hf_config.num_hidden_layers)]
    layers.append(FinalNorm(builder))
    return SequentialLM(layers, None if builder.tied else LMHead(builder), loss_fn)
