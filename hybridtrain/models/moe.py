"""The router load-balancing loss of a mixture-of-experts model, exactly as transformers computes it, across
pipeline stages.

transformers' ``load_balancing_loss_func`` (the same function in every MoE model file) does not add one
term per layer: it sums, over **all** MoE layers of the forward, the per-expert counts of top-k choices
``C`` and the per-expert router probabilities ``P`` (softmax of the router logits) and the rows ``R``, and
only then forms ``E * sum_e (C_e / R) (P_e / R)``. A per-layer term (what DeepSpeed-MoE, Megatron and
torchtitan inject) is a different number, and the gradient of layer ``l``'s probabilities needs the counts
of layers on later stages. So the two partial sums travel with the hidden states: every pipeline layer
passes ``(hidden, position_ids, P [E] float32, C [E] int64)``; the embedding starts them at zero, each MoE
block adds its layer's sums (read from its router's output by a forward hook, since transformers'
decoder layers do not return router logits), and the loss on the last stage forms the term and adds
``router_aux_loss_coef x`` it. ``P`` carries the gradient back to every stage's routers; ``C`` is an
integer count (no gradient), so DeepSpeed's pipeline sends it without one.

A step with many micro-batches: each micro-batch's loss gets its own aux term, and DeepSpeed averages
micro-batch losses over accumulation and data-parallel ranks, so the step's aux term is the **mean over
the step's micro-batches** of transformers' per-forward value (``docs/moe.md``). Every layout cuts a
global batch into the same micro-batches, so it is layout-invariant; the reference loop
(:mod:`hybridtrain.reference`) uses the same definition. hybridtrain feeds no attention mask (position
ids only), so every row counts, as in transformers called without one.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn as nn


def carries_aux(family: Any, hf_config: Any) -> bool:
    """Whether the model's loss includes the load-balancing term, so the pipeline carries ``(P, C)``."""
    return family.moe is not None and family.moe.aux_enabled(hf_config)


def start_sums(family: Any, hf_config: Any, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The zero ``(P, C)`` the embedding starts a micro-batch with. ``P`` requires grad: DeepSpeed's pipeline
    runs a backward from every float output of a stage, even one no router has touched yet."""
    experts = int(getattr(hf_config, family.moe.num_experts))
    return (torch.zeros(experts, dtype=torch.float32, device=device, requires_grad=True),
            torch.zeros(experts, dtype=torch.int64, device=device))


def layer_sums(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One MoE layer's ``(P, C)``: the router probabilities summed over tokens ``[E]`` (float32) and the
    number of top-k choices of each expert ``[E]`` (int64), as ``load_balancing_loss_func`` forms them
    (softmax in the logits' dtype, top-k of it, then the float sum)."""
    experts = router_logits.shape[-1]
    probs = torch.nn.functional.softmax(router_logits.reshape(-1, experts), dim=-1)  # [T, E]
    with torch.no_grad():
        chosen = torch.topk(probs, top_k, dim=-1).indices  # [T, k]
        flat = chosen.reshape(-1)  # [T x k]; counted without bincount (on CUDA it reads min and max to the host)
        counts = torch.zeros(experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return probs.float().sum(dim=0), counts


def load_balancing(p_sum: torch.Tensor, counts: torch.Tensor, rows: float) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` from the summed ``(P, C)`` of all MoE layers and their
    ``rows`` (MoE layers x tokens): ``E * sum_e (C_e / R) (P_e / R)``, in its operation order."""
    experts = p_sum.shape[0]
    tokens_per_expert = counts.to(torch.float32) / rows
    router_prob_per_expert = p_sum / rows
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * experts


class RouterTap:
    """A forward hook on one block's router that hands its logits (output 0) to the block's forward."""

    def __init__(self, router: nn.Module):
        self._logits: list[torch.Tensor] = []
        self._open = False
        router.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        if self._open:
            self._logits.append(output[0] if isinstance(output, tuple) else output)

    @contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Within it, the router's logits of each call are appended to the yielded list."""
        self._logits, self._open = [], True
        try:
            yield self._logits
        finally:
            self._open = False


class AuxLoss:
    """The training loss of an MoE model with ``output_router_logits``: the token loss of ``base`` plus
    ``router_aux_loss_coef x`` :func:`load_balancing` of the carried ``(P, C)``, per micro-batch. Takes the
    last pipeline layer's ``(logits, P, C)``."""

    def __init__(self, base, family: Any, hf_config: Any):
        moe = family.moe
        self.base = base
        self.coef = float(getattr(hf_config, moe.aux_coef))
        self.moe_layers = int(getattr(hf_config, family.n_layers)) - len(moe.dense_blocks(hf_config))
        self.__name__ = getattr(base, "__name__", "loss")

    def __call__(self, outputs, labels) -> torch.Tensor:
        if len(outputs) == 4:  # the head deferred to the loss: (hidden, position_ids, P, C)
            head_out, p_sum, counts = tuple(outputs[:2]), outputs[2], outputs[3]
        else:
            head_out, p_sum, counts = outputs
        first = head_out[0] if isinstance(head_out, tuple) else head_out
        rows = float(self.moe_layers * first.shape[0] * first.shape[1])  # [B, S, V / tp] or [B, S, H]
        cp = getattr(self.base, "cp", None)
        if cp is not None and cp.size > 1:
            # Context parallelism: each rank routed its chunks of the rows. The micro-batch's term is formed from
            # the sums over the cp group (every cp rank adds the same value); the differentiable sum sends each
            # rank's routers the gradient of every rank's copy, which DeepSpeed's average over dp x cp turns
            # back into one micro-batch's gradient.
            from hybridtrain.parallel import collectives

            p_sum = collectives.all_reduce_autograd(p_sum, cp.group)
            counts = collectives.all_reduce_autograd(counts, cp.group)
            rows *= cp.size
        return self.base(head_out, labels) + self.coef * load_balancing(p_sum, counts, rows)


def loss_of(base, family: Any, hf_config: Any):
    """The loss a run trains on: ``base`` (the token loss), with the aux term where the model has one."""
    return AuxLoss(base, family, hf_config) if carries_aux(family, hf_config) else base
