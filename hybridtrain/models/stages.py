"""Pipeline layers: the HF model cut into pieces that pass ``(hidden, position_ids)`` between them
(a mixture-of-experts model with its router loss on: ``(hidden, position_ids, P, C)``, the partial sums of
the load-balancing loss, :mod:`hybridtrain.models.moe`).

DeepSpeed's pipeline may only send tensors (or tuples of tensors) across a stage boundary, and every
float tensor received gets ``requires_grad`` and must send a gradient back; integer tensors travel
without one. So each piece takes and returns ``(hidden [B, S, H], position_ids [B, S] int64)``
(``(input_ids, position_ids)`` into the first, logits out of the head), and the mask and rotary table
are made from the position ids once per stage and micro-batch, by :class:`BlockInputs`. The position ids carry the document boundaries of
packed rows (``data.packing=documents``): they restart at every record, and transformers' masking
turns restarts into a block-causal mask (a token attends only to its own record).
"""
from __future__ import annotations

import dataclasses
import inspect
from functools import partial
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from hybridtrain.checkpoint.hf_state import block_params
from hybridtrain.models import moe
from hybridtrain.models.build import ModelBuilder
from hybridtrain.models.linear_attention import Documents, RankChunks, split_documents
from hybridtrain.models.score import ScoreHead
from hybridtrain.models.units import Kind, model_units
from hybridtrain.parallel.context import CPContext
from hybridtrain.parallel.layers import VocabParallelEmbedding, VocabParallelHead
from hybridtrain.parallel.state_pass import CarryLog
from hybridtrain.parallel.slicing import Split

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
        self.aux = (family, hf) if moe.carries_aux(family, hf) else None
        self.cp = builder.cp
        self.defer = builder.defer_head

    def hf_params(self, include_replicas: bool = False):
        if not include_replicas and getattr(self.weight, "ds_pipe_replicated", False):  # tied copy, last stage
            return []
        return [(self.hf_name, self.weight, Split(dim=0, vocab=self.vocab_size))]

    def forward(self, x: tuple[torch.Tensor, torch.Tensor], as_head: bool = False, compute: bool = False):
        """``(input_ids, position_ids)`` -> ``(hidden [B, S, H], position_ids)`` (and the zero router sums
        ``(P, C)`` of an MoE model's aux loss); as the tied head ``(hidden, position_ids, ...)`` -> logits
        ``[B, S, V_pad/tp]`` (with the carried ``(P, C)`` after them), or, deferred to the loss
        (:attr:`ModelBuilder.defer_head`) and not asked to ``compute``, ``x`` itself."""
        if as_head:
            if self.defer and not compute:
                return x
            return _with_sums(super().forward(x[0], True), x)
        input_ids, positions = x  # [B, S], [B, S]: the whole rows (at cp > 1 the position ids stay whole)
        if self.cp.size > 1:  # this rank's two chunks of every row from here on: [B, S / cp]
            input_ids = input_ids[:, self.cp.indices(input_ids.shape[1], input_ids.device)]
        out = super().forward(input_ids, False)
        out = self.drop(out) if self.drop is not None else out
        if self.aux is None:
            return out, positions
        return (out, positions, *moe.start_sums(*self.aux, out.device))


def _with_sums(logits: torch.Tensor, x: tuple):
    """The head's output: ``logits``, or ``(logits, P, C)`` where the layers carry the router sums."""
    return logits if len(x) == 2 else (logits, *x[2:])


def _softcap(builder: ModelBuilder) -> float | None:
    key = builder.family.final_logit_softcap
    value = getattr(builder.hf_config, key, None) if key else None
    return float(value) if value else None


def tied_head(embedding: TokenEmbedding, x: tuple[torch.Tensor, torch.Tensor], compute: bool = False):
    """``forward_fn`` of the tied head on the last stage: logits from the embedding weight (or ``x`` itself,
    deferred to the loss, unless asked to ``compute``)."""
    return embedding(x, as_head=True, compute=compute)


class PositionEmbedding(nn.Module):
    """GPT-2's learned positions (``wpe``, replicated over TP) plus the embedding dropout."""

    def __init__(self, builder: ModelBuilder):
        super().__init__()
        family = builder.family
        self.wpe = builder.materialize(family.position_embed)
        self.drop = nn.Dropout(float(getattr(builder.hf_config, family.embed_dropout)) if family.embed_dropout else 0.0)
        self.hf_name = f"{family.position_embed}.weight"
        self.cp = builder.cp

    def hf_params(self, include_replicas: bool = False):
        return [(self.hf_name, self.wpe.weight, Split())]

    def forward(self, x: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, positions, *sums = x  # [B, S, H], [B, S]: each record of a packed row starts at position 0
        local = positions if self.cp.size == 1 else positions[:, self.cp.indices(positions.shape[1], positions.device)]
        return self.drop(hidden + self.wpe(local)), positions, *sums


class BlockInputs:
    """The attention arguments (mask, or FlashAttention 2's variable-length offsets) and rotary
    ``(cos, sin)`` the decoder blocks of one stage take for one micro-batch, made once and shared by the
    stage's blocks.

    They depend only on the position ids (which travel with the hidden states, the same tensor through
    every layer of a stage), the hidden states' shape, dtype and device, and whether the attention has
    a sliding window; nothing in them requires grad. So every block of a micro-batch gets the same
    tensors instead of each block rebuilding them (30 times per micro-batch on a 30-block stage:
    per-block Python and small kernels, which a GPU step notices). Keyed by the position-id tensor
    itself (identity, not value: comparing values would synchronise a GPU), kept for sliding-window and
    full attention separately (Gemma 2 alternates them). One instance per rank (:meth:`shared`); a plain
    object, not a module, so that no module is shared between blocks: each block keeps its own rotary
    module (which moves and casts with it), and the first block to meet a micro-batch lends it.
    """

    def __init__(self, hf_config, packed: bool = True, cp: CPContext | None = None, cp_base: str = "sdpa"):
        self.hf_config = hf_config
        self.cp = cp or CPContext()  # size > 1: hidden holds this rank's chunks, the position ids whole rows
        self.cp_base = cp_base
        self.flash = hf_config._attn_implementation == "flash_attention_2"
        self.packed = packed  # False: rows hold one sequence each, so the restart tests (host syncs) are skipped
        # (sliding, layer type) -> (key, position ids, (args, cos_sin)); "documents" -> (_, ids, Documents)
        self._made: dict = {}

    @classmethod
    def shared(cls, builder: ModelBuilder) -> "BlockInputs":
        """This rank's instance (the blocks of a stage are built from one builder)."""
        if cls.__name__ not in builder.stage_shared:
            builder.stage_shared[cls.__name__] = cls(builder.hf_config, builder.packed, builder.cp, builder.cp_base)
        return builder.stage_shared[cls.__name__]

    def __call__(self, hidden: torch.Tensor, pos: torch.Tensor, sliding: bool, rotary: nn.Module | None,
                 layer_type: str | None = None) -> tuple:
        """``(attention kwargs, (cos, sin) or None, local position ids)`` for ``hidden [B, S, H]`` (at cp > 1 this
        rank's ``[B, S / cp, H]``) at the rows' position ids ``pos [B, S]``. ``layer_type``: the block's
        ``config.layer_types`` entry, for a rotary embedding with one table per layer type (Gemma 3, OLMo 3:
        :func:`rotary_layer_type`); ``None``: one table for every block."""
        key = (tuple(hidden.shape[:2]), hidden.dtype, hidden.device, torch.is_inference_mode_enabled())
        which = (sliding, layer_type)
        made = self._made.get(which)
        if made is None or made[0] != key or made[1] is not pos:  # the reference keeps pos's id from reuse
            rope = rotary if layer_type is None or rotary is None else partial(rotary, layer_type=layer_type)
            made = self._made[which] = (key, pos, self._make(hidden, pos, sliding, rope))
        return made[2]

    def documents(self, pos: torch.Tensor) -> Documents | RankChunks | None:
        """The documents of packed rows with the whole rows' position ids ``pos`` (``None``: one per row, or rows built
        unpacked), made once per micro-batch for a stage's linear-attention blocks
        (:class:`~hybridtrain.models.linear_attention.Documents`); at cp > 1 this rank's chunks of the rows and their
        pieces of documents (:class:`~hybridtrain.models.linear_attention.RankChunks`)."""
        if not self.packed and self.cp.size == 1:
            return None
        made = self._made.get("documents")
        if made is None or made[1] is not pos:
            docs = RankChunks.of(pos, self.cp, self.packed) if self.cp.size > 1 else Documents.of(pos)
            made = self._made["documents"] = (None, pos, docs)
        return made[2]

    def _make(self, hidden: torch.Tensor, pos: torch.Tensor, sliding: bool, rotary: nn.Module | None) -> tuple:
        if self.cp.size > 1:
            return self._make_cp(hidden, pos, rotary)
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        with torch.no_grad():
            if not self.packed and pos.device.type == "cpu" and bool((pos[:, 1:] != pos[:, :-1] + 1).any()):
                # free on a CPU (no device to wait for): a model built for one sequence per row never takes
                # packed rows silently with a plain causal mask
                raise RuntimeError("position ids restart inside a row, but this model was built for unpacked rows "
                                   "(ModelBuilder.packed=False, data.packing other than documents)")
            if self.flash:
                args = {"attention_mask": None, **(varlen_kwargs(pos) if self.packed else {})}
            else:
                # sdpa with one sequence per row gets None (is_causal); eager an additive [B, 1, S, S]
                # mask; a sliding window or packed records (position ids that restart) a mask too. The
                # position ids go to the mask only where rows are packed: transformers tests them for
                # restarts with a host read (``find_packed_sequence_indices``), a GPU sync per micro-batch.
                make = create_sliding_window_causal_mask if sliding else create_causal_mask
                args = {"attention_mask": make(config=self.hf_config, inputs_embeds=hidden, attention_mask=None,
                                               cache=None, position_ids=pos if self.packed else None)}
            cos_sin = rotary(hidden, position_ids=pos) if rotary is not None else None
        return args, cos_sin, pos

    def _make_cp(self, hidden: torch.Tensor, pos: torch.Tensor, rotary: nn.Module | None) -> tuple:
        """Context parallelism: the attention gathers the keys and values and masks by global token index from
        the whole rows' position ids (:class:`~hybridtrain.parallel.context_parallel.CPAttention`); the rotary
        table is made for the whole rows and cut to this rank's tokens, so scaled variants that read the row's
        largest position (dynamic, LongRoPE) pick what one process would."""
        from hybridtrain.parallel.context_parallel import CPAttention, flash_segments

        idx = self.cp.indices(pos.shape[1], pos.device)  # [S / cp] global indices of this rank's tokens
        with torch.no_grad():
            segments = flash_segments(pos, idx) if self.cp_base == "flash_attention_2" else None  # one host copy
            args = {"attention_mask": None,
                    # Unpacked rows are one document each: no position ids, so sdpa runs mask-free.
                    "cp_context": CPAttention(self.cp, self.cp_base, position_ids=pos if self.packed else None,
                                              segments=segments)}
            cos_sin = None
            if rotary is not None:
                cos, sin = rotary(hidden, position_ids=pos)  # [B, S, D] each
                cos_sin = (cos[:, idx], sin[:, idx])  # [B, S / cp, D]
        return args, cos_sin, pos[:, idx]


class DecoderBlock(nn.Module):
    """One HF decoder block (``GPT2Block``, ``LlamaDecoderLayer``, ...), TP-sharded.

    It builds the mask its model would give it from the position ids: transformers' sliding-window
    causal mask when the block's attention has a window (its own ``sliding_window``, else the config's:
    Mistral and Phi-3 put one window on every layer, Qwen2/3 and Gemma 2 mark layers in
    ``config.layer_types``), else the causal mask. Where the position ids restart (packed records)
    transformers intersects either mask with "same record" (``find_packed_sequence_indices``); with
    ``flash_attention_2`` the restarts become the variable-length kernel's ``cu_seqlens`` instead.
    """

    def __init__(self, builder: ModelBuilder, index: int):
        super().__init__()
        self.block = builder.block(index)
        self.hf_prefix = f"{builder.family.blocks}.{index}"
        self.family = builder.family
        self.variant = builder.family.variant_of(builder.hf_config, index)  # its tensor-parallel plan's
        self.hf_config = builder.hf_config
        self.checkpointing = builder.activation_checkpointing
        # a linear-attention block (Gated DeltaNet) has no mask, and its mixer runs packed rows per document
        self.linear = builder.family.is_linear_attention(self.variant)
        self.carries = self.linear and builder.cp.size > 1  # its mixer passes a carry between the cp ranks
        if self.linear:
            split_documents(self.block.get_submodule(builder.family.linear_attention.module))
        attention = None if self.linear else self.block.get_submodule(builder.family.attention)
        window = (attention.sliding_window if hasattr(attention, "sliding_window")
                  else getattr(builder.hf_config, "sliding_window", None))
        self.sliding = bool(window) and not self.linear
        self.rotary, self.layer_type = None, None
        if builder.family.rotary_embed:
            rotary_cls = type(builder.hf_model.get_submodule(builder.family.rotary_embed))
            self.rotary = rotary_cls(config=builder.hf_config)
            self.layer_type = rotary_layer_type(self.rotary, builder.hf_config, index)
        self.inputs = BlockInputs.shared(builder)  # nothing float but the hidden states crosses stages
        moe_spec = builder.family.moe
        # experts split over ep and trained: the marker makes DeepSpeed reduce them over their own data-parallel
        # group. Under LoRA they are frozen (adapters go on linear layers only), so no group is needed, and
        # DeepSpeed asserts when a model has MoE layers but no trainable expert parameter.
        if (builder.ep.size > 1 and builder.lora is None
                and index not in moe_spec.dense_blocks(builder.hf_config)):
            from hybridtrain.parallel.experts import expert_marker

            self.moe_marker = expert_marker(int(getattr(builder.hf_config, moe_spec.num_experts)), builder.ep.size)
        self.tap = None  # an MoE block of a model with its aux loss on: the router's logits, per forward
        if moe.carries_aux(builder.family, builder.hf_config) and index not in moe_spec.dense_blocks(builder.hf_config):
            self.tap = moe.RouterTap(self.block.get_submodule(moe_spec.router))
            self.top_k = int(getattr(builder.hf_config, moe_spec.top_k))

    def hf_params(self, include_replicas: bool = False):
        return list(block_params(self.block, self.hf_prefix, self.family, self.hf_config, self.variant))

    def hf_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """``(HF name, tensor)`` of the persistent buffers a checkpoint keeps (``Family.saved_buffers``; whole on
        every rank), those this block has."""
        held = dict(self.block.named_buffers())
        return [(f"{self.hf_prefix}.{name}", held[name]) for name in self.family.saved_buffers if name in held]


    def _run(self, hidden: torch.Tensor, pos: torch.Tensor, log: CarryLog | None = None) -> torch.Tensor:
        args, cos_sin, local_pos = self.inputs(hidden, pos, self.sliding, self.rotary, self.layer_type)
        if self.linear:
            return self._run_linear(hidden, pos, cos_sin, log)
        if cos_sin is None:
            return self.block(hidden, **args)
        return self.block(hidden, position_ids=local_pos, position_embeddings=cos_sin, **args)

    def _run_linear(self, hidden: torch.Tensor, pos: torch.Tensor, cos_sin: tuple | None,
                    log: CarryLog | None = None) -> torch.Tensor:
        """A linear-attention block: no mask (its model gives it none without padding); in packed rows its mixer runs
        once per document, so each starts from a zero recurrent state and conv window; at cp > 1 over the rank's
        chunks with the carry passed between the ranks (``log``: the carries to replay when activation checkpointing
        recomputes the block); the block passes ``documents`` on to it (:mod:`~hybridtrain.models.linear_attention`).
        ``pos``: the whole rows' position ids."""
        if self.carries:
            return self.block(hidden, position_embeddings=cos_sin, documents=self.inputs.documents(pos), carry_log=log)
        return self.block(hidden, position_embeddings=cos_sin, documents=self.inputs.documents(pos))

    def _run_routed(self, hidden: torch.Tensor, pos: torch.Tensor, log: CarryLog | None = None) -> tuple[torch.Tensor, ...]:
        """The block and its router's ``(P, C)`` of this forward (recomputed alike under checkpointing)."""
        with self.tap.capture() as logits:
            out = self._run(hidden, pos, log)
        assert len(logits) == 1, f"{self.hf_prefix}: the router ran {len(logits)} times in one forward"
        return (out, *moe.layer_sums(logits[0], self.top_k))

    def forward(self, x: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, pos, *sums = x  # [B, S, H], [B, S] (, P [E], C [E])
        run = self._run_routed if self.tap is not None else self._run
        if self.checkpointing and self.training and torch.is_grad_enabled():
            # a fresh log per forward: the recomputation replays the carries this forward receives
            out = checkpoint(run, hidden, pos, CarryLog() if self.carries else None, use_reentrant=False)
        else:
            out = run(hidden, pos)
        if self.tap is None:
            return out, pos, *sums
        out, p_sum, counts = out
        return out, pos, sums[0] + p_sum, sums[1] + counts


def rotary_layer_type(rotary: nn.Module, hf_config, index: int) -> str | None:
    """The layer type block ``index`` asks its rotary embedding for: ``config.layer_types[index]`` where the rotary
    module keeps one table per layer type (its ``forward`` takes ``layer_type``: Gemma 3's local and global bases,
    OLMo 3's; their models call it once per type and give each block its type's ``(cos, sin)``), else ``None``."""
    if "layer_type" not in inspect.signature(rotary.forward).parameters:
        return None
    return str(hf_config.layer_types[index])


def varlen_kwargs(pos: torch.Tensor) -> dict:
    """FlashAttention 2's variable-length arguments for rows whose position ids restart (packed records),
    ``{}`` for one sequence per row. transformers infers them from ``position_ids`` only for a batch of
    one row, so they are given explicitly: every restart (position 0, which also starts each row of the
    flattened ``[B * S]`` batch) opens a sequence."""
    if not bool((pos[:, 1:] != pos[:, :-1] + 1).any()):
        return {}
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(pos)
    return {"cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k, "max_length_q": int(max_q), "max_length_k": int(max_k)}


class FinalNorm(nn.Module):
    """The HF final norm (``ln_f`` / ``norm``), replicated over TP."""

    def __init__(self, builder: ModelBuilder):
        super().__init__()
        self.norm = builder.materialize(builder.family.final_norm)
        self.hf_prefix = builder.family.final_norm

    def hf_params(self, include_replicas: bool = False):
        return [(f"{self.hf_prefix}.{n}", p, Split()) for n, p in self.norm.named_parameters()]

    def forward(self, x: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, *rest = x  # rest: position ids (and an MoE model's router sums)
        return self.norm(hidden), *rest


class LMHead(VocabParallelHead):
    """Untied LM head: vocabulary-parallel logits ``[B, S, V_pad/tp]`` (soft-capped where the family does)."""

    def __init__(self, builder: ModelBuilder):
        weight, start = builder.vocab_shard(builder.family.head)
        super().__init__(weight, start, builder.vocab_size, builder.tp, softcap=_softcap(builder))
        self.hf_name = builder.family.checkpoint_name(f"{builder.family.head}.weight")
        self.defer = builder.defer_head

    def hf_params(self, include_replicas: bool = False):
        return [(self.hf_name, self.weight, Split(dim=0, vocab=self.vocab_size))]

    def forward(self, x: tuple[torch.Tensor, ...], compute: bool = False):
        """``(hidden, positions, ...)`` -> logits (, P, C); deferred to the loss (:attr:`ModelBuilder.defer_head`)
        and not asked to ``compute``: ``x`` itself."""
        if self.defer and not compute:
            return x
        return _with_sums(super().forward(x[0]), x)


class SequentialLM(nn.Module):
    """All pipeline layers in one process (pp=1), for DeepSpeed's ordinary engine.

    ``forward((input_ids, position_ids), labels)`` returns the loss of ``loss_fn`` (labels may be
    ``(labels, weight)``): the same interface the pipeline's first and last stages get. A tied head
    reuses the embedding module itself, so its weight is one parameter.
    """

    def __init__(self, layers: list[nn.Module], head: nn.Module | None, loss_fn):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.head = head  # None: tied to layers[0]
        self.loss_fn = loss_fn

    def logits(self, inputs) -> torch.Tensor:
        """This tensor-parallel rank's vocabulary shard of the logits ``[B, S, V / tp]`` of
        ``(input_ids, position_ids)``, or of ``input_ids`` alone (one sequence per row)."""
        out = self.outputs(inputs, compute=True)
        return out[0] if isinstance(out, tuple) else out

    def outputs(self, inputs, compute: bool = False):
        """What the head gives the loss: the logits shard, or ``(logits, P, C)`` (an MoE model's router sums);
        with the head deferred to the loss (and not asked to ``compute``), the head's input."""
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs, torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs))
        x = inputs
        for layer in self.layers:
            x = layer(x)
        return self.head_of(x, compute)

    def head_of(self, x, compute: bool = False):
        """The head (the tied embedding's, or the LM head) on the last layer's output ``x``."""
        return self.layers[0](x, as_head=True, compute=compute) if self.head is None else self.head(x, compute=compute)

    def forward(self, inputs, labels) -> torch.Tensor:
        return self.loss_fn(self.outputs(inputs), labels)


def one_process_model(cfg, hf_config) -> "SequentialLM":
    """hybridtrain's whole model of a run's config at tp = 1 in this process, with its loss: what the
    family checks, the packing tests and ``bench/model_step.py`` compare against transformers' model. It takes
    packed rows whatever ``data.packing`` says."""
    from hybridtrain.models.families.base import padded_vocab
    from hybridtrain.parallel.context import TPContext
    from hybridtrain.parallel.layers import VocabParallelLoss

    tp, padded = TPContext(), padded_vocab(int(hf_config.vocab_size), 1)
    builder = dataclasses.replace(ModelBuilder.for_run(cfg, hf_config, tp, padded), packed=True)  # any rows
    token_loss = VocabParallelLoss(padded, tp, chunk_tokens=cfg.trainer.loss_chunk_tokens)
    model = sequential_model(builder, moe.loss_of(token_loss, builder.family, hf_config))
    if builder.defer_head:
        token_loss.head = lambda x: model.head_of(x, compute=True)
    return model


def sequential_model(builder: ModelBuilder, loss_fn, partition: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """All units in this process (pp = 1); a tied head reuses the embedding module. ``partition``, when
    given, is called on each layer as soon as it is built (ZeRO-3 partitions it then, so the rank never
    holds the whole model at once)."""
    layers: list[nn.Module] = []
    head = None
    for unit in model_units(builder.family, builder.hf_config):
        if unit.kind is Kind.BLOCK:
            layer = DecoderBlock(builder, unit.index)
        elif unit.kind is Kind.HEAD and builder.score_head:  # a reward model: the scalar head, no logits
            head = layer = ScoreHead(builder)
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
