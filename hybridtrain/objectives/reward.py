"""The Bradley-Terry loss of TRL 1.16's ``RewardTrainer`` (``finetune.objective=reward``), under any layout.

A micro-batch holds whole pairs, one per row (:class:`~hybridtrain.data.sampler.PairSamples` over
:func:`~hybridtrain.data.preference.scored_rows`: the whole chosen sequence, then the whole rejected one). The
model's head (:class:`~hybridtrain.models.score.ScoreHead`) scores every token; a sequence's reward is its
score at the one position whose label is not ``-100`` (its last token that is not the pad token, where
transformers' ``...ForSequenceClassification`` pools), gathered per document (row x segment) with an
``index_add``. Under context parallelism each rank holds some tokens of every row: the per-document sums are
all-reduced over the cp group (differentiably), every cp rank forms the same pair losses and returns them
divided by cp, as :mod:`hybridtrain.objectives.dpo` does (its docstring has why that is exact).

Per pair ``-logsigmoid(r_chosen - r_rejected)``, plus ``center_rewards_coefficient x (r_chosen + r_rejected)^2``
when set (TRL's ``torch.mean`` over the batch's pairs of that); the returned loss is the micro-batch's sum times
the pair weight of :meth:`~hybridtrain.data.sampler.PairSamples.batch_weights`, so the step's loss is the mean
over the global batch's pairs (``RewardTrainer.compute_loss`` over a batch of that size).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hybridtrain.objectives.stats import StepSums


STATS = ("accuracy", "margin", "mean_reward")
"""The per-step metrics under TRL's ``RewardTrainer`` names: the share of pairs whose chosen sequence scores
higher, the mean ``r_chosen - r_rejected``, the mean reward over both sequences of every pair."""


class RewardLoss:
    """The loss function of ``finetune.objective=reward`` (DeepSpeed's ``loss_fn``: per micro-batch on the last
    pipeline stage, or in the sequential model) over the head's scores and the target
    ``(labels, weights, segments, reference, index)`` of :class:`~hybridtrain.data.sampler.PairSamples` (the
    reference is unused). Adds each micro-batch's :data:`STATS` sums to :attr:`stats` (:meth:`take_stats`)."""

    names = STATS
    """The metric names :meth:`take_stats` sums, in order (:func:`hybridtrain.train.preference.step_metrics`)."""

    def __init__(self, cp: Any, reward: Any):
        self.cp = cp
        """The context-parallel context (its group all-reduces the rewards)."""
        coefficient = reward.center_rewards_coefficient
        self.center = None if coefficient is None else float(coefficient)
        self.stats = StepSums(len(STATS) + 1)
        self.__name__ = "reward_loss"

    def rewards(self, scores: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """``[B, 2]`` fp32: each row's chosen and rejected reward, the ``scores`` ``[B, T]`` (this rank's tokens)
        at the positions ``labels`` mark, over the whole rows (all cp ranks')."""
        cp = self.cp
        if cp.size > 1:  # [B, S] -> this rank's tokens [B, S / cp], as the embedding took them
            keep = cp.indices(labels.shape[1], labels.device)
            labels, segments = labels[:, keep], segments[:, keep]
        rows = labels.shape[0]
        doc = (torch.arange(rows, device=labels.device).unsqueeze(1) * 2 + segments).reshape(-1)  # [B x T]
        at = ((segments >= 0) & (labels != -100)).reshape(-1)  # one position per sequence, on one cp rank
        sums = scores.new_zeros(2 * rows, dtype=torch.float32).index_add(0, doc[at], scores.reshape(-1)[at].float())
        if cp.size > 1:
            from hybridtrain.parallel import collectives

            sums = collectives.all_reduce_autograd(sums, cp.group)
        return sums.reshape(rows, 2)

    def __call__(self, outputs, target) -> torch.Tensor:
        labels, weights, segments, _reference, _index = target
        rewards = self.rewards(outputs, labels, segments)
        chosen, rejected = rewards.unbind(-1)
        per_pair = -F.logsigmoid(chosen - rejected)
        if self.center is not None:
            per_pair = per_pair + self.center * (chosen + rejected) ** 2
        self._add_stats(rewards.detach())
        return per_pair.sum() * weights[0].to(per_pair.dtype) / self.cp.size

    def _add_stats(self, rewards: torch.Tensor) -> None:
        chosen, rejected = rewards.unbind(-1)
        sums = torch.stack([(chosen > rejected).float().sum(), (chosen - rejected).sum(), rewards.sum() / 2,
                            rewards.new_tensor(float(len(chosen)))])
        self.stats.add(sums)

    def take_stats(self, device) -> torch.Tensor:
        """This rank's :data:`STATS` sums and pair count since the last call (``[4]`` float64; zeros on a rank
        that computed no loss), reset."""
        return self.stats.take(device)
