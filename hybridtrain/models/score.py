"""The scalar head of a reward model (``finetune.objective=reward``): transformers' ``score`` of
``...ForSequenceClassification`` with ``num_labels=1``, in place of the LM head.

``score`` is ``Linear(hidden, 1, bias=False)`` on the final norm's output. It is replicated over tensor
parallelism: the hidden states are whole on every tp rank after the blocks' row-parallel all-reduce, so each
rank computes the same scores, and its gradient (counted on tp rank 0 only, as every replicated parameter) is
the one replica's; the hidden states' gradient flows back unchanged (no "f" all-reduce, unlike the
vocabulary-parallel head, whose ranks each hold part of the logits). Under pp it is the last stage's head
unit; the LM head (or the tied copy of the embedding) is never built, so nothing computes logits.

Its starting value: ``score.weight`` of ``model.pretrained`` (or a checkpoint's ``hf/``) when the folder holds
one (a reward model's folder), else what transformers gives the head it adds when it loads a causal-LM folder
into ``AutoModelForSequenceClassification`` after ``set_seed(trainer.seed)`` (TRL's ``RewardTrainer`` does
exactly that): the model's own ``_init_weights`` on the new ``Linear`` as the first draw of torch's generator
seeded with ``trainer.seed`` (``tests/unit/test_reward_model.py`` checks it equals transformers' for every dense
family but Qwen3.5, whose loading draws other values before the head).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from hybridtrain.parallel.slicing import Split

SCORE = "score.weight"
"""The head's tensor name in an HF ``...ForSequenceClassification`` folder."""


def initial_score(hf_model: nn.Module, hidden: int, seed: int, weights: Any = None) -> torch.Tensor:
    """The head's ``[1, hidden]`` fp32 starting weight: ``weights``' (a :class:`~hybridtrain.models.weights.
    SafetensorsWeights`) :data:`SCORE` if it holds one, else transformers' initialisation under ``seed``."""
    if weights is not None and SCORE in weights:
        tensor = weights.get(SCORE)
        if tuple(tensor.shape) != (1, hidden):
            from hybridtrain.models.weights import CheckpointError

            raise CheckpointError(f"{weights.folder}: {SCORE} has shape {tuple(tensor.shape)}, "
                                  f"but a reward model's head is [1, {hidden}] (num_labels=1)")
        return tensor.float()
    score = nn.Linear(hidden, 1, bias=False)
    with torch.random.fork_rng(devices=[]):  # as from_pretrained after set_seed(seed): the first draw
        torch.manual_seed(seed)
        hf_model._init_weights(score)
    return score.weight.detach().float()


class ScoreHead(nn.Module):
    """The reward head as a pipeline layer: ``(hidden [B, S, H], position_ids, ...)`` -> scores ``[B, S]``
    of every token (the loss reads each sequence's last, :mod:`hybridtrain.objectives.reward`)."""

    def __init__(self, builder: Any):
        super().__init__()
        hidden = int(getattr(builder.hf_config, builder.family.hidden))
        self.weight = nn.Parameter(initial_score(builder.hf_model, hidden, builder.seed, builder.weights))

    def hf_params(self, include_replicas: bool = False):
        return [(SCORE, self.weight, Split())]

    def forward(self, x: tuple[torch.Tensor, ...], compute: bool = False):
        hidden = x[0]  # [B, S, H] (at cp > 1 this rank's [B, S / cp, H])
        scores = nn.functional.linear(hidden, self.weight.to(hidden.dtype)).squeeze(-1)  # [B, S]
        return scores if len(x) == 2 else (scores, *x[2:])  # an MoE model's router sums travel on
