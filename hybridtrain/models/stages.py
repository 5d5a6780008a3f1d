"""Pipeline layers: the HF model cut into pieces that pass one tensor between them.

DeepSpeed's pipeline may only send tensors across a stage boundary, and every float tensor
received gets ``requires_grad``; so each piece takes and returns the hidden states
``[B, S, H]`` only (token ids ``[B, S]`` into the first), and the causal mask, positions and
rotary tables are recomputed inside every block.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from hybridtrain.checkpoint.hf_state import Split, block_params
from hybridtrain.models.build import ModelBuilder
from hybridtrain.models.units import Kind, model_units
from hybridtrain.parallel.layers import VocabParallelEmbedding, VocabParallelHead

# Every layer below has ``hf_params()``: ``(HF name, parameter, Split)`` for what it holds, so a
# checkpoint or an export can be written under HF names whatever the plan.


class TokenEmbedding(VocabParallelEmbedding):
    """HF token embedding, vocabulary-parallel; also the tied LM head (``as_head=True``).

    It carries the family's model-level operations around the lookup: the embedding scale (Gemma),
    the pad row that gets no gradient (HF's ``padding_idx``), the dropout after the embedding when
    there is no position embedding to carry it (GPT-NeoX), and, as the tied head, the final logit
    soft-cap (Gemma 2).
    """

    def __init__(self, builder: ModelBuilder):
        family, hf = builder.family, builder.hf_config
        weight, start = builder.vocab_shard(family.embed)
        super().__init__(weight, start, builder.vocab_size, builder.tp,
                         padding_idx=getattr(builder.hf_model.get_submodule(family.embed), "padding_idx", None),
                         scale=float(getattr(hf, family.hidden)) ** 0.5 if family.embed_scale else None,
                         softcap=_softcap(builder))
        self.drop = (nn.Dropout(float(getattr(hf, family.embed_dropout)))
                     if family.embed_dropout and not family.position_embed else None)
        self.hf_name = family.checkpoint_name(f"{family.embed}.weight")

    def hf_params(self, include_replicas: bool = False):
        if not include_replicas and getattr(self.weight, "ds_pipe_replicated", False):  # tied copy, last stage
            return []
        return [(self.hf_name, self.weight, Split(dim=0, vocab=self.vocab_size))]

    def forward(self, x: torch.Tensor, as_head: bool = False) -> torch.Tensor:
        out = super().forward(x, as_head)
        return self.drop(out) if self.drop is not None and not as_head else out


def _softcap(builder: ModelBuilder) -> float | None:
    key = builder.family.final_logit_softcap
    value = getattr(builder.hf_config, key, None) if key else None
    return float(value) if value else None


def tied_head(embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """``forward_fn`` of the tied head on the last stage: logits from the embedding weight."""
    return embedding(hidden, as_head=True)


class PositionEmbedding(nn.Module):
    """GPT-2's learned positions (``wpe``, replicated over TP) plus the embedding dropout."""

    def __init__(self, builder: ModelBuilder):
        super().__init__()
        family = builder.family
        self.wpe = builder.materialize(family.position_embed)
        self.drop = nn.Dropout(float(getattr(builder.hf_config, family.embed_dropout)) if family.embed_dropout else 0.0)
        self.hf_name = f"{family.position_embed}.weight"

    def hf_params(self, include_replicas: bool = False):
        return [(self.hf_name, self.wpe.weight, Split())]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, S, H]
        pos = torch.arange(hidden.shape[1], device=hidden.device)
        return self.drop(hidden + self.wpe(pos).unsqueeze(0))


class DecoderBlock(nn.Module):
    """One HF decoder block (``GPT2Block``, ``LlamaDecoderLayer``, ...), TP-sharded.

    It builds the mask its model would give it: transformers' sliding-window causal mask when the
    block's attention has a window (its own ``sliding_window``, else the config's: Mistral and Phi-3
    put one window on every layer, Qwen2/3 and Gemma 2 mark layers in ``config.layer_types``), else the
    causal mask.
    """

    def __init__(self, builder: ModelBuilder, index: int):
        super().__init__()
        self.block = builder.block(index)
        self.hf_prefix = f"{builder.family.blocks}.{index}"
        self.family = builder.family
        self.hf_config = builder.hf_config
        self.checkpointing = builder.activation_checkpointing
        attention = self.block.get_submodule(builder.family.attention)
        window = (attention.sliding_window if hasattr(attention, "sliding_window")
                  else getattr(builder.hf_config, "sliding_window", None))
        self.sliding = bool(window)
        self.rotary = None
        if builder.family.rotary_embed:  # each block rebuilds the table: nothing float crosses stages
            rotary_cls = type(builder.hf_model.get_submodule(builder.family.rotary_embed))
            self.rotary = rotary_cls(config=builder.hf_config)

    def hf_params(self, include_replicas: bool = False):
        return list(block_params(self.block, self.hf_prefix, self.family, self.hf_config))

    def _run(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # [1, S]
        # sdpa without padding gets None (is_causal); eager gets an additive [B, 1, S, S] mask;
        # a sliding window a bool mask once the sequence reaches the window.
        make = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        mask = make(config=self.hf_config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=pos)
        if self.rotary is None:
            return self.block(hidden, attention_mask=mask)
        cos_sin = self.rotary(hidden, position_ids=pos)
        return self.block(hidden, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, S, H] -> [B, S, H]
        if self.checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._run, hidden, use_reentrant=False)
        return self._run(hidden)


class FinalNorm(nn.Module):
    """The HF final norm (``ln_f`` / ``norm``), replicated over TP."""

    def __init__(self, builder: ModelBuilder):
        super().__init__()
        self.norm = builder.materialize(builder.family.final_norm)
        self.hf_prefix = builder.family.final_norm

    def hf_params(self, include_replicas: bool = False):
        return [(f"{self.hf_prefix}.{n}", p, Split()) for n, p in self.norm.named_parameters()]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


class LMHead(VocabParallelHead):
    """Untied LM head: vocabulary-parallel logits ``[B, S, V_pad/tp]`` (soft-capped where the family does)."""

    def __init__(self, builder: ModelBuilder):
        weight, start = builder.vocab_shard(builder.family.head)
        super().__init__(weight, start, builder.vocab_size, builder.tp, softcap=_softcap(builder))
        self.hf_name = builder.family.checkpoint_name(f"{builder.family.head}.weight")

    def hf_params(self, include_replicas: bool = False):
        return [(self.hf_name, self.weight, Split(dim=0, vocab=self.vocab_size))]


class SequentialLM(nn.Module):
    """All pipeline layers in one process (pp=1), for DeepSpeed's ordinary engine.

    ``forward(input_ids, labels)`` returns the loss of ``loss_fn`` (labels may be ``(labels, weight)``); a tied head reuses the embedding
    module itself, so its weight is one parameter.
    """

    def __init__(self, layers: list[nn.Module], head: nn.Module | None, loss_fn):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.head = head  # None: tied to layers[0]
        self.loss_fn = loss_fn

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This tensor-parallel rank's vocabulary shard of the logits ``[B, S, V / tp]``."""
        hidden = input_ids
        for layer in self.layers:
            hidden = layer(hidden)
        return self.layers[0](hidden, as_head=True) if self.head is None else self.head(hidden)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.logits(input_ids), labels)


def sequential_model(builder: ModelBuilder, loss_fn, partition: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """All units in this process (pp = 1); a tied head reuses the embedding module. ``partition``, when
    given, is called on each layer as soon as it is built (ZeRO-3 partitions it then, so the rank never
    holds the whole model at once)."""
    layers: list[nn.Module] = []
    head = None
    for unit in model_units(builder.family, builder.hf_config):
        if unit.kind is Kind.BLOCK:
            layer = DecoderBlock(builder, unit.index)
        elif unit.kind is Kind.HEAD:
            head = layer = None if unit.tied else LMHead(builder)
        else:
            layer = LAYER_CLASSES[unit.kind](builder)
        if layer is not None and partition is not None:
            partition(layer)
        if unit.kind is not Kind.HEAD:
            layers.append(layer)
    return SequentialLM(layers, head, loss_fn)


LAYER_CLASSES = {Kind.EMBED: TokenEmbedding, Kind.POS_EMBED: PositionEmbedding, Kind.FINAL_NORM: FinalNorm,
                 Kind.HEAD: LMHead}
"""The layer class of each unit kind but blocks (built with their index)."""
