"""Tensor-parallel styles: one class per way a block submodule is split over the TP group.

A family's plan (:class:`~hybridtrain.models.families.TPRule`) names a style by string (``"column"``,
``"row"``, ...); :func:`style_of` gives its :class:`TPStyle`, which is the one place that knows what a
rank keeps of the module's parameters (:meth:`TPStyle.split`, from which :meth:`~TPStyle.keep` for the
seeded initialisation and the checkpoint reads follow), how the module is replaced by its shard
(:meth:`~TPStyle.shard`) and where LoRA adapters go on it. A new style (say, 3-D expert weights) is one
more subclass in :data:`STYLES`.

Dimensions: :class:`~hybridtrain.parallel.slicing.Split` is in the local ``[out, in]`` layout; HF's
``Conv1D`` stores the weight ``[in, out]``, so the HF dimension of a transposed weight is the other one.
Imports neither torch nor deepspeed at module level (the family data and the planner read it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from hybridtrain.parallel.slicing import Fused, Split, local_part, shard_ranges, shard_tensor

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from hybridtrain.parallel.context import TPContext

Reader = Callable[[str, Optional[int], Fused], "torch.Tensor"]
"""``read(leaf, hf_dim, fused)``: this rank's shard of the module's parameter ``leaf`` (``"weight"``,
``"bias"``) in HF layout, split along ``hf_dim`` (``None``: the whole tensor), e.g. from a checkpoint."""


def hf_dim(split: Split) -> Optional[int]:
    """The dimension of the HF-layout tensor that ``split`` splits (``None``: replicated)."""
    if split.dim is None:
        return None
    return 1 - split.dim if split.transpose else split.dim


class TPStyle:
    """How one block submodule is split over TP; subclasses are stateless, one instance each."""

    name: str = ""
    """The style's name in a :class:`~hybridtrain.models.families.TPRule`."""
    lora: bool = False
    """Whether a LoRA adapter can sit on a module of this style (the block's linear layers)."""

    def split(self, leaf: str, conv1d: bool = False, fused: Fused = 1) -> Split:
        """How this rank's local ``leaf`` parameter (``"weight"``, ``"bias"``) relates to the HF tensor;
        ``conv1d``: HF stores the weight ``[in, out]``; ``fused``: sub-blocks along the outputs."""
        raise NotImplementedError

    def sharded(self, leaf: str) -> bool:
        """Whether a rank holds only a part of parameter ``leaf`` (the cost model's sharded bytes)."""
        return self.split(leaf).dim is not None

    def reads_shards(self) -> bool:
        """Whether :meth:`shard` reads this module's split parameters itself (from a checkpoint, with
        ``read``), so loading the whole unit skips them."""
        return self.sharded("weight")

    def keep(self, module: "nn.Module", conv1d: bool, fused: Fused, rank: int, size: int) -> dict:
        """``leaf -> (HF dim, [lo, hi) ranges)`` of the parameters of ``module`` (full, HF layout) that
        rank ``rank`` of ``size`` keeps; parameters kept whole are not named."""
        keep = {}
        for leaf, param in module.named_parameters(recurse=False):
            split = self.split(leaf, conv1d, fused)
            dim = hf_dim(split)
            if dim is not None:
                keep[leaf] = (dim, shard_ranges(int(param.shape[dim]), split.fused, rank, size))
        return keep

    def shard(self, module: "nn.Module", rule: Any, fused: Fused, tp: "TPContext",
              read: Optional[Reader] = None) -> "nn.Module":
        """The module that replaces ``module`` (full) on this rank (``module`` itself where it stays),
        its shards cut from ``module`` or, with ``read``, read (:data:`Reader`). ``rule``: the
        :class:`~hybridtrain.models.families.TPRule` (``conv1d``, ``replace``)."""
        raise NotImplementedError

    def lora_splits(self, fused: Fused = 1) -> tuple[Split, Split]:
        """How this rank's LoRA ``A`` ``[r, in]`` and ``B`` ``[out, r]`` relate to the full ones: cut like
        the layer's weight, never transposed (peft stores them as ``nn.Linear`` weights, even on a ``Conv1D``)."""
        raise self._no_lora()

    def lora_numel(self, r: int, n_in: int, n_out: int, tp: int) -> tuple[int, int]:
        """Elements of ``A`` and ``B`` one TP rank holds for a module of ``n_in`` x ``n_out`` features."""
        raise self._no_lora()

    def lora_layer(self, layer: "nn.Module", a: "torch.Tensor", b: "torch.Tensor", scaling: float, dropout: float,
                   tp: "TPContext") -> "nn.Module":
        """The LoRA-adapted ``layer`` (this style's sharded linear) with this rank's ``a`` and ``b``."""
        raise self._no_lora()


    def _no_lora(self) -> ValueError:
        return ValueError(f"a {self.name!r} module carries no LoRA adapter (only the block's linear layers do)")


class _Linear(TPStyle):
    """A linear layer (``nn.Linear``, or HF ``Conv1D`` with ``rule.conv1d``) split along one dimension."""

    lora = True

    def _layer(self, weight: "torch.Tensor", bias: Optional["torch.Tensor"], tp: "TPContext") -> "nn.Module":
        raise NotImplementedError

    def shard(self, module, rule, fused, tp, read=None):
        has_bias = getattr(module, "bias", None) is not None
        leaves = ("weight", "bias") if has_bias else ("weight",)
        splits = {leaf: self.split(leaf, rule.conv1d, fused) for leaf in leaves}
        if read is not None:
            parts = {leaf: read(leaf, hf_dim(s), s.fused) for leaf, s in splits.items()}
            if splits["weight"].transpose:
                parts["weight"] = parts["weight"].t().contiguous()  # -> [out, in]
            full = list(module.weight.t().shape if rule.conv1d else module.weight.shape)  # [out, in]
            full[splits["weight"].dim] //= tp.size
            want = tuple(full)
            if tuple(parts["weight"].shape) != want:
                raise ValueError(f"checkpoint shard of shape {tuple(parts['weight'].shape)} does not fit the "
                                 f"configured model's {want}; the model config does not match the checkpoint")
        else:
            parts = {}
            for leaf, split in splits.items():
                tensor = getattr(module, leaf).detach()
                tensor = tensor.t() if split.transpose else tensor  # -> [out, in]
                parts[leaf] = local_part(tensor, split, tp.rank, tp.size)
        return self._layer(parts["weight"], parts.get("bias"), tp)


class Column(_Linear):
    """``column``: a linear whose output features (and bias) are split, each fused sub-block (q | k | v) on
    its own; its input gets Megatron's "f". LoRA: ``A`` replicated, ``B``'s rows split like the weight's."""

    name = "column"

    def split(self, leaf, conv1d=False, fused=1):
        return Split(dim=0, fused=fused, transpose=conv1d and leaf == "weight")

    def _layer(self, weight, bias, tp):
        from hybridtrain.parallel.layers import ColumnParallelLinear

        return ColumnParallelLinear(weight, bias)

    def lora_splits(self, fused=1):
        return Split(), Split(dim=0, fused=fused)

    def lora_numel(self, r, n_in, n_out, tp):
        return r * n_in, n_out // tp * r

    def lora_layer(self, layer, a, b, scaling, dropout, tp):
        from hybridtrain.parallel.lora import LoraColumnParallelLinear

        return LoraColumnParallelLinear(layer, a, b, scaling, dropout, tp)


class Row(_Linear):
    """``row``: a linear whose input features are split; its partial output is all-reduced ("g"), the bias
    is replicated and added after. LoRA: ``A``'s columns split like the weight's, ``B`` replicated."""

    name = "row"

    def split(self, leaf, conv1d=False, fused=1):
        return Split(dim=1, transpose=conv1d) if leaf == "weight" else Split()

    def _layer(self, weight, bias, tp):
        from hybridtrain.parallel.layers import RowParallelLinear

        return RowParallelLinear(weight, bias, tp)

    def lora_splits(self, fused=1):
        return Split(dim=1), Split()

    def lora_numel(self, r, n_in, n_out, tp):
        return r * n_in // tp, n_out * r

    def lora_layer(self, layer, a, b, scaling, dropout, tp):
        from hybridtrain.parallel.lora import LoraRowParallelLinear

        return LoraRowParallelLinear(layer, a, b, scaling, dropout, tp)


class Norm(TPStyle):
    """``norm``: an RMS norm over the full output width of a column-parallel linear (OLMo 2's q/k norm): its
    weight is split like that linear's rows and its statistics are summed over the TP group, forward and
    backward (the family supplies the sharded module, ``TPRule.replace(module, weight_shard, width, tp)``)."""

    name = "norm"

    def split(self, leaf, conv1d=False, fused=1):
        return Split(dim=0)

    def shard(self, module, rule, fused, tp, read=None):
        width = int(module.weight.shape[0])
        shard = read("weight", 0, 1) if read is not None else shard_tensor(module.weight.detach(), 0, 1, tp.rank, tp.size)
        return rule.replace(module, shard, width, tp)


class GradSum(TPStyle):
    """``grad_sum``: a replicated module fed by this rank's heads only (Qwen3's per-head q/k norm): the
    forward is right as is, the weight gradient is partial and is summed over the TP group."""

    name = "grad_sum"

    def split(self, leaf, conv1d=False, fused=1):
        return Split()

    def shard(self, module, rule, fused, tp, read=None):
        from hybridtrain.parallel.layers import sum_grad_over_tp

        for param in module.parameters():
            sum_grad_over_tp(param, tp)
        return module


class GradSumLinear(GradSum):
    """``grad_sum_linear``: a :class:`GradSum` linear layer (DeepSeek-V3's low-rank ``q_a_proj`` and
    ``kv_a_proj_with_mqa``, whole on every rank inside the tensor-parallel region, read by this rank's heads only)
    that LoRA can adapt, as peft's ``all-linear`` does: ``A`` and ``B`` whole, their gradients partial like the
    weight's and summed over the TP group the same way."""

    name = "grad_sum_linear"
    lora = True

    def lora_splits(self, fused=1):
        return Split(), Split()

    def lora_numel(self, r, n_in, n_out, tp):
        return r * n_in, n_out * r

    def lora_layer(self, layer, a, b, scaling, dropout, tp):
        from hybridtrain.parallel.layers import sum_grad_over_tp
        from hybridtrain.parallel.lora import LoraReplicatedLinear

        adapted = LoraReplicatedLinear(layer, a, b, scaling, dropout)
        sum_grad_over_tp(adapted.lora_A.weight, tp)
        sum_grad_over_tp(adapted.lora_B.weight, tp)
        return adapted


class Replicated(TPStyle):
    """``replicated``: a linear layer outside the tensor-parallel region, kept whole on every rank (Qwen2-MoE's
    ``shared_expert_gate``, which reads the block's input beside the router): its input and output are the
    same on every TP rank and so are its gradients, so nothing is split or reduced. It is named only so that
    a LoRA adapter can sit on it, as peft's ``all-linear`` puts one there: ``A`` and ``B`` whole, plain peft
    LoRA, no collective."""

    name = "replicated"
    lora = True

    def split(self, leaf, conv1d=False, fused=1):
        return Split()

    def shard(self, module, rule, fused, tp, read=None):
        return module

    def lora_splits(self, fused=1):
        return Split(), Split()

    def lora_numel(self, r, n_in, n_out, tp):
        return r * n_in, n_out * r

    def lora_layer(self, layer, a, b, scaling, dropout, tp):
        from hybridtrain.parallel.lora import LoraReplicatedLinear

        return LoraReplicatedLinear(layer, a, b, scaling, dropout)


class Experts(TPStyle):
    """``experts``: transformers' fused 3-D experts module (``*Experts``: ``gate_up_proj [E, 2I, H]``, gate |
    up fused along dim 1, ``down_proj [E, H, I]``) split over every expert's MLP width ``I``: ``gate_up_proj``
    column-wise, its gate and up halves each on their own (dim 1, two fused blocks), ``down_proj`` row-wise
    (dim 2). The module keeps its HF forward (``config._experts_implementation``) on the slices; Megatron's
    "f" goes on its two float inputs (the routed hidden states and the top-k weights, both with partial
    gradients on each rank) and "g" (one all-reduce) on its output (:mod:`hybridtrain.parallel.experts`).
    transformers' own plan for it is ``packed_colwise`` / ``rowwise`` / ``moe_tp_experts``."""

    name = "experts"
    LEAVES = {"gate_up_proj": (1, 2), "down_proj": (2, 1)}
    """Parameter -> (split dimension, fused blocks) in HF layout (the local layout is HF's)."""

    def split(self, leaf, conv1d=False, fused=1):
        if leaf not in self.LEAVES:
            return Split()
        dim, blocks = self.LEAVES[leaf]
        return Split(dim=dim, fused=blocks, experts=True)  # dim 0: the experts, split over parallel.ep

    def reads_shards(self) -> bool:
        return True

    def shard(self, module, rule, fused, tp, read=None):
        from hybridtrain.parallel.experts import shard_experts

        return shard_experts(module, {leaf: self.split(leaf) for leaf in self.LEAVES}, tp, read)


class InterleavedExperts(Experts):
    """``experts_interleaved``: gpt-oss's experts module (transposed, biased, gate and up interleaved:
    ``gate_up_proj [E, H, 2I]`` with gate at the even and up at the odd columns, ``gate_up_proj_bias [E, 2I]``,
    ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``). Rank ``r``'s gate slice ``r`` and up slice ``r`` are
    one contiguous run of the interleaved dimension, still interleaved, so ``gate_up_proj`` and its bias split
    as one block along it; ``down_proj`` row-wise (dim 1); ``down_proj_bias`` is replicated and added once, by
    TP rank 0, to the sum of the ranks' partial outputs (:func:`hybridtrain.parallel.experts.shard_experts`)."""

    name = "experts_interleaved"
    LEAVES = {"gate_up_proj": (2, 1), "gate_up_proj_bias": (1, 1), "down_proj": (1, 1)}
    ONCE = ("down_proj_bias",)
    """Replicated over TP, added by one rank: the bias after the row-parallel down projection."""

    def split(self, leaf, conv1d=False, fused=1):
        return Split(experts=True) if leaf in self.ONCE else super().split(leaf, conv1d, fused)

    def shard(self, module, rule, fused, tp, read=None):
        from hybridtrain.parallel.experts import shard_experts

        leaves = (*self.LEAVES, *self.ONCE)
        return shard_experts(module, {leaf: self.split(leaf) for leaf in leaves}, tp, read, once=self.ONCE)


class Heads(TPStyle):
    """``heads``: a module's own per-head parameters (gpt-oss's attention ``sinks [num_heads]``), split along
    dim 0 like the heads of its column-parallel q projection; its child modules keep rules of their own."""

    name = "heads"

    def split(self, leaf, conv1d=False, fused=1):
        return Split(dim=0)

    def shard(self, module, rule, fused, tp, read=None):
        import torch.nn as nn

        from hybridtrain.parallel.layers import tag_sharded

        for leaf, param in list(module.named_parameters(recurse=False)):
            part = read(leaf, 0, 1) if read is not None else shard_tensor(param.detach(), 0, 1, tp.rank, tp.size)
            if tuple(part.shape) != (int(param.shape[0]) // tp.size, *param.shape[1:]):
                raise ValueError(f"checkpoint shard of {leaf} of shape {tuple(part.shape)} does not fit the configured "
                                 f"model's {int(param.shape[0]) // tp.size} heads; the model config does not match "
                                 "the checkpoint")
            new = nn.Parameter(part.to(param.dtype).contiguous(), requires_grad=param.requires_grad)
            setattr(module, leaf, tag_sharded(new, 0) if tp.size > 1 else new)
        return module


class Channels(TPStyle):
    """``channels``: a depthwise (``groups = channels``) causal ``nn.Conv1d`` over the outputs of a column-parallel
    linear (Gated DeltaNet's ``conv1d`` over q | k | v): every channel is filtered on its own, so a rank keeps the
    filters of its own channels, each fused sub-block split on its own like the linear's rows (weight
    ``[C, 1, K]`` split along dim 0), and the conv needs no collective. The replacement is an ``nn.Conv1d`` of
    ``C / tp`` channels with the same kernel, padding and bias setting."""

    name = "channels"

    def split(self, leaf, conv1d=False, fused=1):
        return Split(dim=0, fused=fused)

    def shard(self, module, rule, fused, tp, read=None):
        import torch.nn as nn

        from hybridtrain.parallel.layers import tag_sharded

        channels = int(module.weight.shape[0]) // tp.size
        new = nn.Conv1d(channels, channels, module.kernel_size[0], groups=channels, padding=module.padding[0],
                        bias=module.bias is not None, device="meta")
        for leaf, param in module.named_parameters(recurse=False):
            part = (read(leaf, 0, fused) if read is not None
                    else shard_tensor(param.detach(), 0, fused, tp.rank, tp.size))  # [C / tp, 1, K]
            if tuple(part.shape) != (channels, *param.shape[1:]):
                raise ValueError(f"checkpoint shard of {leaf} of shape {tuple(part.shape)} does not fit the configured "
                                 f"model's {channels} channels per rank; the model config does not match the checkpoint")
            shard = nn.Parameter(part.to(param.dtype).contiguous(), requires_grad=param.requires_grad)
            setattr(new, leaf, tag_sharded(shard, 0) if tp.size > 1 else shard)
        return new


STYLES: dict[str, TPStyle] = {s.name: s for s in (Column(), Row(), Norm(), GradSum(), GradSumLinear(), Replicated(),
                                                   Experts(), InterleavedExperts(), Heads(), Channels())}
"""Every tensor-parallel style by its name in a ``TPRule``."""


def style_of(name: str) -> TPStyle:
    """The :class:`TPStyle` called ``name``; :class:`ValueError` naming the known ones otherwise."""
    try:
        return STYLES[name]
    except KeyError:
        raise ValueError(f"unknown tensor-parallel style {name!r}; use one of {list(STYLES)}") from None
