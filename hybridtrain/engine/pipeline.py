"""The model as DeepSpeed pipeline layers (pp > 1); at pp = 1 the engine takes
:func:`hybridtrain.models.stages.sequential_model`."""
from __future__ import annotations

from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from hybridtrain.models.build import ModelBuilder
from hybridtrain.models.units import Kind, model_units
from hybridtrain.models.score import ScoreHead
from hybridtrain.models.stages import LAYER_CLASSES, DecoderBlock, TokenEmbedding, tied_head
from hybridtrain.parallel.context import TPContext
from hybridtrain.parallel.dims import ParallelDims
from hybridtrain.parallel.groups import bind_pipeline_tp


class HybridPipelineModule(PipelineModule):
    """``PipelineModule`` with the plan's stage boundaries and the grid's TP group published.

    DeepSpeed creates its process groups (``PipelineParallelGrid``) before partitioning and builds
    the local ``LayerSpec``s after, so ``_partition_layers`` is the one point where the TP group
    exists and no layer has been built yet.
    """

    def __init__(self, *, dims: ParallelDims, tp: TPContext, stage_bounds: list[int], **kwargs):
        self._hybrid_tp = tp
        self._hybrid_bounds = list(stage_bounds)
        self._hybrid_dims = dims
        super().__init__(topology=dims.topology(), **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        bind_pipeline_tp(self, self._hybrid_tp)
        assert len(self._hybrid_bounds) == self.num_stages + 1
        assert self._hybrid_bounds[-1] == len(self._layer_specs), "plan and layer list disagree"
        self.parts = self._hybrid_bounds
        stage = self._hybrid_dims.coords(self.global_rank).pp
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def layer_specs(builder: ModelBuilder) -> list:
    """One DeepSpeed layer spec per pipeline unit (:func:`~hybridtrain.models.units.model_units`).

    A tied head is a ``TiedLayerSpec`` of the embedding: first and last stage each build it, their
    gradients are summed after every step and the weight is kept identical.
    """
    specs = []
    for unit in model_units(builder.family, builder.hf_config):
        if unit.kind is Kind.EMBED and builder.tied:
            specs.append(TiedLayerSpec("embed", TokenEmbedding, builder, tied_weight_attr="weight"))
        elif unit.kind is Kind.HEAD and builder.score_head:  # a reward model: the scalar head, not tied
            specs.append(LayerSpec(ScoreHead, builder))
        elif unit.kind is Kind.HEAD and unit.tied:
            specs.append(TiedLayerSpec("embed", TokenEmbedding, builder, forward_fn=tied_head, tied_weight_attr="weight"))
        elif unit.kind is Kind.BLOCK:
            specs.append(LayerSpec(DecoderBlock, builder, unit.index))
        else:
            specs.append(LayerSpec(LAYER_CLASSES[unit.kind], builder))
    return specs
