"""Tensor parallelism of transformers' fused 3-D experts module (the ``experts`` style of
:mod:`hybridtrain.parallel.tensor`).

transformers keeps a mixture-of-experts layer's routed experts in one module (``Qwen3MoeExperts``,
``MixtralExperts``, ...) holding ``gate_up_proj [E, 2I, H]`` (gate | up fused along dim 1) and
``down_proj [E, H, I]``, whose forward is picked by ``config._experts_implementation`` (``grouped_mm`` by
default, also on CPU). Each rank keeps its slice of every expert's MLP width ``I`` (gate and up halves
sliced each on its own) and runs that same HF forward on the slices: each expert's SwiGLU is
element-wise in ``I``, so the rank's output is its partial sum of the full output, and one all-reduce
over the TP group ("g") completes it. Both float inputs get Megatron's "f" (identity forward,
all-reduce backward): the hidden states routed to the experts and the top-k weights, since a rank's
partial output gives them partial gradients. The router stays outside this region (replicated, full
gradients on every rank), so nothing else in the block is all-reduced.

The parameters keep their HF names and layout (only their ``I`` dimension shrinks) and are tagged like
every TP shard (``tensor_model_parallel``, ``partition_dim``) so DeepSpeed's gradient norm counts each
shard once.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Mapping, Optional

import torch
import torch.nn as nn

from hybridtrain.parallel.context import EPContext, TPContext
from hybridtrain.parallel.layers import copy_to_tp, reduce_from_tp, tag_sharded
from hybridtrain.parallel.slicing import Split, local_part

EXPERTS_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")
"""The experts module's forward arguments, in transformers' order (every ``*Experts.forward``)."""


def shard_experts(module: nn.Module, splits: Mapping[str, Split], tp: TPContext, read=None,
                  once: tuple[str, ...] = ()) -> nn.Module:
    """Keep this rank's slice of ``module``'s fused expert weights (``splits``: leaf -> :class:`Split` in
    HF layout), cut from the module or, with ``read(leaf, dim, fused)``, read from a checkpoint; with
    tp > 1 wrap its forward in "f" on the float inputs and "g" on the output. ``once``: replicated biases
    added after the row-parallel down projection (gpt-oss's ``down_proj_bias``), which only TP rank 0 adds
    to its partial output (:class:`_BiasOnce`), so the sum over the group holds them once. Returns ``module``
    itself (its parameter names stay HF's)."""
    for leaf, split in splits.items():
        full = getattr(module, leaf)
        want = list(full.shape)
        if split.dim is not None:  # else replicated over tp (``once``), read whole
            want[split.dim] //= tp.size
        if read is not None:
            part = read(leaf, split.dim, split.fused)
        else:
            part = local_part(full.detach(), split, tp.rank, tp.size)
        if list(part.shape) != want:
            raise ValueError(f"experts shard {leaf} of shape {tuple(part.shape)} does not fit the configured "
                             f"model's {tuple(want)}; the model config does not match the checkpoint")
        param = nn.Parameter(part.to(full.dtype).contiguous(), requires_grad=full.requires_grad)
        sharded = tp.size > 1 and split.dim is not None  # a ``once`` bias is replicated: counted once in the norm
        setattr(module, leaf, tag_sharded(param, split.dim) if sharded else param)
    for attr in ("intermediate_dim", "intermediate_size"):  # the per-rank width (gpt-oss: intermediate_size)
        if hasattr(module, attr):
            setattr(module, attr, getattr(module, attr) // tp.size)
    if tp.size > 1:
        module.register_forward_pre_hook(_CopyExpertInputs(tp), with_kwargs=True)
        if once and tp.rank > 0:
            bias = _BiasOnce(once)
            module.register_forward_pre_hook(bias.zero)
            module.register_forward_hook(bias.restore)
        module.register_forward_hook(_ReduceExpertOutput(tp))
    return module


class _BiasOnce:
    """On TP ranks other than 0: the experts forward reads each of ``leaves`` (a bias added after the down
    projection, replicated over TP) as ``b - b.detach()``, exactly zero, while its gradient is still ``b``'s
    own: every rank's output gradient is the full one (the "g" after the experts passes it through), so each
    rank's bias gradient is rank 0's, the complete gradient of the replicated bias, with no collective. The
    zeros shadow the parameter in the module's instance dictionary (attribute lookup finds them before
    ``nn.Module``'s parameters) from the pre-hook to the forward hook; ``named_parameters`` and the state
    dict still see the parameter."""

    def __init__(self, leaves: tuple[str, ...]):
        self.leaves = leaves

    def zero(self, module, args) -> None:
        for leaf in self.leaves:
            bias = module._parameters[leaf]
            module.__dict__[leaf] = bias - bias.detach()

    def restore(self, module, args, output) -> None:
        for leaf in self.leaves:
            module.__dict__.pop(leaf, None)


class _CopyExpertInputs:
    """Forward pre-hook: "f" on the experts' hidden states and top-k weights (positional or keyword)."""

    def __init__(self, tp: TPContext):
        self.tp = tp

    def __call__(self, module, args, kwargs):
        args, kwargs = list(args), dict(kwargs)
        for i, name in enumerate(EXPERTS_INPUTS):
            if name == "top_k_index":
                continue
            if i < len(args):
                args[i] = copy_to_tp(args[i], self.tp)
            elif name in kwargs:
                kwargs[name] = copy_to_tp(kwargs[name], self.tp)
        return tuple(args), kwargs


class _ReduceExpertOutput:
    """Forward hook: "g", the sum of the ranks' partial expert outputs."""

    def __init__(self, tp: TPContext):
        self.tp = tp

    def __call__(self, module, args, output: torch.Tensor) -> Optional[torch.Tensor]:
        return reduce_from_tp(output, self.tp)


def expert_group_name(ep: int) -> str:
    """The name DeepSpeed files the expert-parallel and expert-data-parallel groups of degree ``ep`` under
    (``deepspeed.utils.groups``), and that every expert parameter carries as ``group_name``."""
    return f"ep_size_{ep}"


def keep_expert_rows(module: nn.Module, ep: EPContext) -> nn.Module:
    """Give ``module``'s fused expert weights (not yet holding values: a checkpoint fills them) the shape of this
    rank's ``E / ep`` experts, ``[E / ep, ...]`` on the meta device, so that :func:`shard_experts` reads only
    those from the checkpoint; :func:`split_experts_over_ep` then keeps them as they are (``sliced``)."""
    start, stop = ep.shard(int(module.num_experts))
    for leaf, full in list(module.named_parameters(recurse=False)):
        rows = torch.empty((stop - start, *full.shape[1:]), dtype=full.dtype, device="meta")  # [E / ep, ...]
        setattr(module, leaf, nn.Parameter(rows, requires_grad=full.requires_grad))
    return module


def split_experts_over_ep(module: nn.Module, ep: EPContext, sliced: bool = False) -> nn.Module:
    """Keep this rank's ``E / ep`` experts of ``module`` (already TP-sharded, :func:`shard_experts`; with
    ``sliced`` they are all it holds already, read so by :func:`keep_expert_rows`) and route its tokens to the
    experts' owners (:class:`ExpertDispatch`). The expert parameters are tagged for DeepSpeed's MoE handling
    (``allreduce=False`` and the group name): their gradients are reduced over the expert-data-parallel group,
    the ``dp / ep`` ranks holding the same experts, instead of over dp."""
    start, stop = ep.shard(int(module.num_experts))
    for leaf in list(dict(module.named_parameters(recurse=False))):
        full = getattr(module, leaf)
        rows = full.detach() if sliced else full.detach()[start:stop].clone()  # [E / ep, ...]
        assert rows.shape[0] == stop - start, (leaf, tuple(rows.shape), ep)
        param = nn.Parameter(rows, requires_grad=full.requires_grad)
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(full, attr):
                setattr(param, attr, getattr(full, attr))
        param.allreduce = False
        param.group_name = expert_group_name(ep.size)
        setattr(module, leaf, param)
    module.num_experts = stop - start  # what transformers' experts implementations size their groups by
    module.forward = ExpertDispatch(module, ep, num_experts=stop - start)
    return module


class ExpertDispatch:
    """The forward of an expert-parallel experts module (installed as the module's ``forward``, so the module's
    hooks, the TP "f" and "g" among them, still run around it): dropless dispatch over the EP group.

    Every (token, slot) pair goes to the rank holding its expert: pairs sorted by expert (so grouped by owner),
    split sizes exchanged (``all_to_all``), rows and local expert ids sent (rows differentiably, uneven and
    empty splits allowed); the owner runs transformers' own experts forward on what it received (each row
    with its one expert at weight 1), the outputs go back the same way, and the sender weights them by its
    top-k weights and sums over the slots, in the order transformers' ``grouped_mm`` does. No capacity, no
    dropped token. A rank that receives nothing still takes part in both exchanges (and their backward)."""

    def __init__(self, module: nn.Module, ep: EPContext, num_experts: int):
        self.module = module
        self.ep = ep
        self.local = num_experts
        self.peak_load = 0.0
        """Most pairs this rank's experts ran in one forward, over the pairs its own tokens sent, since
        :meth:`take_peak_load` (from the split sizes the dispatch reads anyway: no extra host read)."""

    def take_peak_load(self) -> float:
        """:attr:`peak_load`, reset."""
        peak, self.peak_load = self.peak_load, 0.0
        return peak

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        from hybridtrain.parallel import collectives

        tokens, k = top_k_index.shape  # [T, k]
        ids = top_k_index.reshape(-1)  # [S = T x k]
        order = torch.argsort(ids, stable=True)  # pairs by expert, hence by owner
        owners = ids // self.local  # [S]
        # counted without bincount, which reads the ids' min and max to the host on CUDA (two more syncs)
        sent = torch.zeros(self.ep.size, dtype=torch.int64, device=ids.device).scatter_add_(
            0, owners, torch.ones_like(owners))  # [ep] pairs to each owner
        received = collectives.all_to_all_counts(sent, self.ep.group)
        splits = torch.cat([sent, received]).tolist()  # the one host read per layer forward: the splits (dropless)
        in_splits, out_splits = splits[:self.ep.size], splits[self.ep.size:]
        self.last_received = sum(out_splits)  # rows this rank's experts ran in the last forward (tests, observers)
        self.peak_load = max(self.peak_load, self.last_received / max(1, ids.numel()))
        rows = collectives.all_to_all_rows(hidden_states[order // k], out_splits, in_splits, self.ep.group)  # [R, H]
        with torch.no_grad():
            local_ids = collectives.all_to_all_rows((ids[order] % self.local)[:, None], out_splits, in_splits,
                                                    self.ep.group)  # [R, 1]
        if rows.shape[0]:
            ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
            out = type(self.module).forward(self.module, rows, local_ids, ones)  # [R, H]
        else:  # nothing routed here: keep the (empty) rows in the graph, so the backward exchange runs too
            out = rows * 0
        back = collectives.all_to_all_rows(out, in_splits, out_splits, self.ep.group)  # [S, H], in `order`
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        pairs = back[inverse]  # [S, H] in (token, slot) order
        weighted = pairs * top_k_weights.reshape(-1, 1)
        return weighted.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)  # [T, H]


def expert_marker(num_experts: int, ep: int) -> nn.Module:
    """A parameter-less module whose presence tells DeepSpeed's engine the model has MoE layers
    (``has_moe_layers``: it looks for ``deepspeed.moe.layer.MoE`` instances), so that it reduces the tagged
    expert gradients over their expert-data-parallel group and splits them into their own ZeRO groups.
    DeepSpeed's own MoE layer is not used (it drops tokens by capacity: not transformers-exact)."""
    return _marker_class()(num_experts, ep)


@lru_cache(maxsize=None)
def _marker_class():
    from deepspeed.moe.layer import MoE

    class ExpertMarker(MoE):
        """Stands for one MoE layer to DeepSpeed; holds nothing, runs nothing."""

        def __init__(self, num_experts: int, ep: int):
            nn.Module.__init__(self)  # not MoE.__init__: no DeepSpeed experts, gate or groups
            self.num_experts, self.ep_size = num_experts, ep
            self.num_local_experts = num_experts // ep  # read by DeepSpeed's MoE checkpoint save
            self.expert_group_name = expert_group_name(ep)
            self.enable_expert_tensor_parallelism = True

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass  # the groups are hybridtrain's (parallel/groups.py), filed in DeepSpeed's registry

        def forward(self, *args, **kwargs):
            raise RuntimeError("ExpertMarker only marks an MoE layer for DeepSpeed; it has no forward")

    return ExpertMarker
