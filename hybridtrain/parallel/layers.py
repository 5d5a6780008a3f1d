"""Megatron-style tensor-parallel layers built from weight shards.

The collectives are DeepSpeed's own autograd ops (``deepspeed.module_inject.layers``:
``ColumnParallel`` = identity forward / all-reduce backward, ``RowParallel`` = all-reduce
forward / identity backward) run on the pipeline grid's TP group, and the loss is DeepSpeed's
``vocab_parallel_cross_entropy``. DeepSpeed's *layer classes* (``LinearLayer``,
``VocabParallelEmbedding``) are not used: they shard an already materialised full module in
place under AutoTP's process-wide mode flags, while hybridtrain builds each shard directly
(from a seeded init or, later, a safetensors slice) on the local stage only.

Sharded parameters carry ``tensor_model_parallel=True`` and ``partition_dim`` so that
DeepSpeed's gradient-norm computation counts every shard once (replicated parameters stay
untagged and are counted on TP rank 0 only).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridtrain.parallel.context import CPContext, TPContext


def tag_sharded(param: nn.Parameter, dim: int) -> nn.Parameter:
    """Mark ``param`` as split over the TP group along ``dim`` (read by DeepSpeed's grad norm)."""
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1
    return param


def copy_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Megatron "f": identity forward, all-reduce of the input gradient over the TP group."""
    if tp.size == 1:
        return x
    from deepspeed.module_inject.layers import ColumnParallel

    return ColumnParallel.apply(tp.group, x)


def reduce_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Megatron "g": all-reduce (sum) forward over the TP group, identity backward."""
    if tp.size == 1:
        return x
    from deepspeed.module_inject.layers import RowParallel

    # RowParallel reduces ``x.contiguous()`` in place and returns ``x``: pass a contiguous tensor.
    return RowParallel.apply(tp.group, x.contiguous(), False)


class ColumnParallelLinear(nn.Module):
    """``y[..., out/tp] = x W_r^T + b_r``: output features split, weight ``[out/tp, in]``.

    The input is expected to be already wrapped by :func:`copy_to_tp` (once per module input,
    see ``input_copy`` in the family plans), so the layer itself runs no collective.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = tag_sharded(nn.Parameter(weight), 0)
        self.bias = tag_sharded(nn.Parameter(bias), 0) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, in] -> [B, S, out/tp]
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r W_r^T + b``: input features split, weight ``[out, in/tp]``, bias replicated."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.weight = tag_sharded(nn.Parameter(weight), 1)
        self.bias = nn.Parameter(bias) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, in/tp] -> [B, S, out]
        y = reduce_from_tp(F.linear(x, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with rows ``[vocab_start, vocab_end)`` of the padded vocabulary.

    ``forward(ids)`` looks up local rows and all-reduces; ``forward(hidden, as_head=True)`` is the
    tied LM head: vocabulary-parallel logits ``[B, S, V_pad/tp]`` with padded columns masked to
    ``-inf`` (they never win the softmax and get no gradient). Calling the head through this
    module's ``forward`` keeps ZeRO-3 parameter gathering working for the tied weight.

    ``padding_idx`` (HF's ``nn.Embedding(padding_idx=...)``): that row gets no gradient from the lookup.
    ``scale`` multiplies the lookup only, in the weight's dtype (Gemma's sqrt(hidden)); ``softcap`` caps
    the head's logits (Gemma 2).
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int, vocab_size: int, tp: TPContext,
                 padding_idx: int | None = None, scale: float | None = None, softcap: float | None = None):
        super().__init__()
        self.tp = tp
        self.weight = tag_sharded(nn.Parameter(weight), 0)  # [V_pad/tp, H]
        self.vocab_start = vocab_start
        self.vocab_end = vocab_start + weight.shape[0]
        self.vocab_size = vocab_size  # real (unpadded) vocabulary
        inside = padding_idx is not None and vocab_start <= padding_idx < self.vocab_end
        self.local_padding_idx = padding_idx - vocab_start if inside else None
        self.scale = scale
        self.softcap = softcap

    def forward(self, x: torch.Tensor, as_head: bool = False) -> torch.Tensor:
        if as_head:
            return vocab_parallel_logits(x, self.weight, self.vocab_start, self.vocab_size, self.tp, self.softcap)
        if self.tp.size == 1:
            out = F.embedding(x, self.weight, padding_idx=self.local_padding_idx)
        else:
            outside = (x < self.vocab_start) | (x >= self.vocab_end)  # [B, S]
            local = (x - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight, padding_idx=self.local_padding_idx)
            out = reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0.0), self.tp)  # [B, S, H]
        if self.scale is not None:
            out = out * self.scale_in(self.weight.dtype)
        return out

    def scale_in(self, dtype: torch.dtype) -> float:
        """The embedding scale as HF applies it, ``tensor(scale).to(dtype)`` (fp32, then the weight's dtype:
        bf16 rounds sqrt(hidden)), as a Python number: a tensor made on the device every forward would be a
        host-to-device copy per micro-batch. Exact: the kernel computes in fp32 either way and the number is
        the rounded value itself."""
        return float(torch.tensor(self.scale).to(dtype))


class VocabParallelHead(nn.Module):
    """Untied LM head: weight ``[V_pad/tp, H]``, returns vocabulary-parallel logits (no gather)."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, vocab_size: int, tp: TPContext,
                 softcap: float | None = None):
        super().__init__()
        self.tp = tp
        self.weight = tag_sharded(nn.Parameter(weight), 0)
        self.vocab_start = vocab_start
        self.vocab_size = vocab_size
        self.softcap = softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(x, self.weight, self.vocab_start, self.vocab_size, self.tp, self.softcap)


def vocab_parallel_logits(x: torch.Tensor, weight: torch.Tensor, vocab_start: int, vocab_size: int,
                          tp: TPContext, softcap: float | None = None) -> torch.Tensor:
    """``[B, S, H] -> [B, S, V_pad/tp]`` logits of this rank's vocabulary slice, padding masked.

    ``softcap`` (Gemma 2's final logit soft-cap) is element-wise, so exact on a shard; it comes before
    the padding mask, which would otherwise turn ``-inf`` into a finite ``-softcap``.
    """
    logits = F.linear(copy_to_tp(x, tp), weight)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    n_real = max(0, min(weight.shape[0], vocab_size - vocab_start))
    if n_real < weight.shape[0]:  # padded rows (vocab padded to a multiple of tp)
        pad = torch.arange(weight.shape[0], device=logits.device) >= n_real
        logits = logits.masked_fill(pad, float("-inf"))
    return logits


class ShardedRMSNorm(nn.Module):
    """OLMo 2's RMSNorm over a width split across the TP group (its q/k norm over all heads).

    Each rank holds the slice of the input and of the weight that matches its column-parallel rows;
    the sum of squares is all-reduced over the group in the forward *and* the backward (every rank
    uses the total, so each must get back the whole gradient: Megatron's identity-backward "g"
    would be wrong here). The formula is ``Olmo2RMSNorm``'s: statistics and the weight product in
    fp32, then the cast back.
    """

    def __init__(self, weight: torch.Tensor, eps: float, full_width: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.weight = tag_sharded(nn.Parameter(weight), 0)
        self.variance_epsilon = eps
        self.full_width = full_width

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, W/tp]
        dtype = x.dtype
        x32 = x.to(torch.float32)
        sumsq = x32.pow(2).sum(-1, keepdim=True)
        if self.tp.size > 1:
            from torch.distributed.nn.functional import all_reduce  # autograd: all-reduce backward too

            sumsq = all_reduce(sumsq, group=self.tp.group)
        x32 = x32 * torch.rsqrt(sumsq / self.full_width + self.variance_epsilon)
        return (self.weight * x32).to(dtype)


def sum_grad_over_tp(param: nn.Parameter, tp: TPContext) -> None:
    """Sum ``param``'s gradient over the TP group as autograd produces it (before it accumulates into
    ``.grad`` and before DeepSpeed's reduction hooks): for a replicated parameter that each rank uses
    with its own heads only (Qwen3's per-head q/k norm), whose per-rank gradient is partial."""
    if tp.size == 1:
        return

    def reduce(grad: torch.Tensor) -> torch.Tensor:
        from hybridtrain.parallel import collectives

        return collectives.all_reduce(grad.clone(), grad.device, group=tp.group)  # grads live on the device

    param.register_hook(reduce)


class VocabParallelLoss:
    """Token cross-entropy over vocabulary-parallel logits (DeepSpeed's implementation at tp > 1,
    torch's ``cross_entropy`` at tp = 1).

    No rank ever holds full-vocabulary logits: max, sum-exp and the target logit are all-reduced
    over the TP group. Labels equal to ``-100`` are ignored. Called with plain labels it returns the
    mean over the micro-batch's loss tokens; with ``(labels, weight)`` (what training feeds, see
    :meth:`hybridtrain.data.sampler.Samples.batch_weight`) the summed token loss times ``weight``,
    so that the step's loss is the mean over all loss tokens of the global batch.

    With context parallelism (``cp``, size > 1) the logits are this rank's tokens of every row and the labels
    the whole rows ``[B, S]``: the loss takes the labels of its tokens and returns their summed loss times
    ``weight`` (which counts the cp ranks among those DeepSpeed averages over). Plain labels give the mean over
    this rank's own loss tokens.
    """

    def __init__(self, padded_vocab: int, tp: TPContext, cp: CPContext | None = None, chunk_tokens: int = 4096):
        self.padded_vocab = padded_vocab
        self.tp = tp  # read at call time: the group is bound after construction
        self.cp = cp or CPContext()
        self.chunk_tokens = chunk_tokens
        self.head = None
        """With the head deferred to the loss (``ModelBuilder.defer_head``): the callable that makes the logits
        ``[B, T, V_pad/tp]`` of ``(hidden [B, T, H], position_ids)``, the head module's own call (so ZeRO-3
        gathers its weight); bound once the model exists (:func:`hybridtrain.engine.build`)."""
        self.__name__ = "vocab_parallel_cross_entropy"

    def __call__(self, logits, labels) -> torch.Tensor:
        """``logits [B, S, V_pad/tp]``, or with the head deferred the head's input ``(hidden, position_ids, ...)``."""
        labels, weight = labels if isinstance(labels, (tuple, list)) else (labels, None)
        if self.cp.size > 1:  # [B, S] -> this rank's tokens [B, S / cp], as the embedding took them
            labels = labels[:, self.cp.indices(labels.shape[1], labels.device)]
        if isinstance(logits, (tuple, list)):
            loss = self._in_pieces(logits[0], logits[1], labels)
        else:
            loss = self._summed(logits, labels)
        if weight is None:  # the micro-batch's mean (0 when it has no loss token, as DeepSpeed's)
            return loss / (labels != -100).sum().clamp_min(1).to(loss.dtype)
        return loss * weight.to(loss.dtype)

    def _summed(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed token loss of ``logits [B, T, V_pad/tp]`` at ``labels [B, T]`` (``-100``: none)."""
        if self.tp.size == 1:
            # Nothing is split: torch's fused cross-entropy does the same sum in fewer passes over
            # the logits (the sharded version costs 5% of a tp=1 step on a small model).
            return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100, reduction="sum")
        # DeepSpeed's autograd function itself, not its ``vocab_parallel_cross_entropy`` wrapper: the wrapper
        # checks every call that each label is in the vocabulary with ``.item()``, a forced GPU-to-CPU sync
        # per micro-batch (deepspeed 0.19.8, ``sequence/cross_entropy.py``). The plan guarantees it: labels
        # are token ids, and the model's vocabulary holds the tokenizer's (``plan/validate.py``).
        from deepspeed.sequence.cross_entropy import _VocabParallelCrossEntropy

        start, stop = self.tp.shard(self.padded_vocab)
        return _VocabParallelCrossEntropy.apply(logits, labels, self.tp.group, start, stop, -100).sum()

    def _in_pieces(self, hidden: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed token loss of the head on ``hidden [B, S, H]``, made ``chunk_tokens`` tokens at a time:
        each piece's logits exist only inside its own checkpointed call (made again in the backward), so the
        rank holds one piece's logits, never the micro-batch's. The pieces' sums add up to :meth:`_summed`'s."""
        from torch.utils.checkpoint import checkpoint

        assert self.head is not None, "the head is deferred to the loss but was never bound to it"
        tokens = hidden.reshape(1, -1, hidden.shape[-1])  # [1, B x S, H]: pieces may cross rows
        flat = labels.reshape(1, -1)  # [1, B x S]
        where = torch.zeros_like(flat)  # the head ignores positions; a placeholder of the shape it expects
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, tokens.shape[1], self.chunk_tokens):
            piece = slice(start, start + self.chunk_tokens)
            total = total + checkpoint(self._piece, tokens[:, piece], where[:, piece], flat[:, piece],
                                       use_reentrant=False)
        return total

    def _piece(self, hidden: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._summed(self.head((hidden, positions)), labels)

    def token_losses(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        """The per-token loss ``[B, T]`` (``-log p(label)``, 0 where the label is ``-100``) of this rank's tokens:
        what :meth:`__call__` sums, for objectives that reduce it per sequence (:mod:`hybridtrain.objectives`).
        ``outputs``: the logits ``[B, T, V_pad/tp]``, or with the head deferred the head's input; ``labels``
        this rank's (with cp already its tokens)."""
        if not isinstance(outputs, (tuple, list)):
            return self._per_token(outputs, labels)
        from torch.utils.checkpoint import checkpoint

        hidden = outputs[0]
        tokens = hidden.reshape(1, -1, hidden.shape[-1])  # [1, B x T, H], cut into pieces as _in_pieces does
        flat = labels.reshape(1, -1)
        where = torch.zeros_like(flat)
        pieces = [checkpoint(self._piece_tokens, tokens[:, s:s + self.chunk_tokens], where[:, s:s + self.chunk_tokens],
                             flat[:, s:s + self.chunk_tokens], use_reentrant=False)
                  for s in range(0, tokens.shape[1], self.chunk_tokens)]
        return torch.cat(pieces, dim=1).reshape(labels.shape)

    def _piece_tokens(self, hidden: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._per_token(self.head((hidden, positions)), labels)

    def _per_token(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``-log softmax(logits)[label]`` ``[B, T]`` in fp32, over the vocabulary split across the TP group."""
        if self.tp.size == 1:
            flat = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100, reduction="none")
            return flat.reshape(labels.shape)
        from deepspeed.sequence.cross_entropy import _VocabParallelCrossEntropy  # see _summed

        start, stop = self.tp.shard(self.padded_vocab)
        return _VocabParallelCrossEntropy.apply(logits, labels, self.tp.group, start, stop, -100)
