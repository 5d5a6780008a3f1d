"""The reference-free preference losses of TRL 1.16's ``CPOTrainer`` (``finetune.objective=cpo``: CPO, SimPO,
hinge, IPO, AlphaPO rewards) and ``ORPOTrainer`` (``finetune.objective=orpo``), under any layout.

No reference model is run or cached: the losses are functions of the policy's own per-sequence
log-probabilities. Those come from :func:`~hybridtrain.objectives.dpo.segment_sums`, as DPO's do: per row,
the summed ``log p(label)`` and the loss-token count of the chosen and the rejected completion (and, for
ORPO, of the chosen prompt: its NLL runs over the whole chosen sequence), each all-reduced over the cp group
before any ratio is formed, so a per-token mean (``ipo``, ``simpo``, ORPO) divides the whole sequence's sum by
its whole count under every cp, tp and pp layout.

The step's loss is TRL's over one batch of the step's pairs (``trainer.global_batch_size`` pairs): the pair
term ``mean over the pairs``, the NLL term ``mean over the batch's chosen tokens`` (TRL's
``nn.CrossEntropyLoss()`` over the concatenated chosen rows), each micro-batch returning its sums times the
weights of :meth:`~hybridtrain.data.sampler.PairSamples.batch_weights`, divided by cp as DPO's loss is
(``docs/preference.md``). Formulas: ``CPOTrainer.cpo_loss`` / ``concatenated_forward`` and
``ORPOTrainer.odds_ratio_loss`` / ``get_batch_loss_metrics``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hybridtrain.objectives import CPO_LOSS_TYPES, CPO_STATS, ORPO_STATS
from hybridtrain.objectives.dpo import segment_sums
from hybridtrain.objectives.stats import StepSums


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, TRL's stable form (ORPO's odds of a mean log-probability)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def cpo_rewards(alpha: float, logps: torch.Tensor) -> torch.Tensor:
    """The per-sequence rewards before ``beta``: the log-probabilities, or AlphaPO's ``(1 - p^-alpha) / alpha``."""
    if alpha == 0.0:
        return logps
    return (1 - torch.exp(logps).pow(-alpha)) / alpha


def cpo_pair_loss(loss_type: str, beta: float, label_smoothing: float, gamma: float, alpha: float,
                  logps: torch.Tensor) -> torch.Tensor:
    """TRL's ``CPOTrainer.cpo_loss`` losses ``[P]`` from ``logps`` ``[P, 2]`` (chosen, rejected; per-token
    means for ``ipo`` and ``simpo``)."""
    rewards = cpo_rewards(alpha, logps)
    logits = rewards[:, 0] - rewards[:, 1]
    if loss_type in ("sigmoid", "simpo"):
        if loss_type == "simpo":
            logits = logits - gamma / beta
        return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    if loss_type == "hinge":
        return torch.relu(1 - beta * logits)
    if loss_type == "ipo":
        return (logits - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown CPO loss type {loss_type!r}; use one of {list(CPO_LOSS_TYPES)}")


class ReferenceFreeLoss:
    """The loss function of ``finetune.objective=cpo`` or ``orpo`` (DeepSpeed's ``loss_fn``), over the target
    ``(labels, weights, segments, reference, index)`` of :class:`~hybridtrain.data.sampler.PairSamples`
    (``reference`` unused: zeros). For ``orpo`` the samples carry the chosen prompt's labels as segment 2
    (:attr:`~hybridtrain.data.sampler.PairSamples.prompt_nll`). Each micro-batch's metric sums accumulate in
    :attr:`stats` (:meth:`take_stats`, :meth:`metrics`)."""

    def __init__(self, token_loss: Any, objective: str, cfg: Any):
        self.token_loss = token_loss
        self.objective = str(objective)
        self.beta = float(cfg.beta)
        if self.objective == "cpo":
            self.loss_type, self.label_smoothing = str(cfg.loss_type), float(cfg.label_smoothing)
            self.cpo_alpha, self.gamma, self.alpha = float(cfg.cpo_alpha), float(cfg.simpo_gamma), float(cfg.alpha)
            self.average = self.loss_type in ("ipo", "simpo")
        else:
            self.average = True
        self.names = CPO_STATS if self.objective == "cpo" else ORPO_STATS
        """The metric names :meth:`metrics` returns, TRL's."""
        self.pair_stats = len(self.names) - 1  # every name but nll_loss is a mean over pairs
        self.stats = StepSums(self.pair_stats + 3)
        self.__name__ = f"{self.objective}_loss"

    @property
    def cp(self):
        """The context-parallel context (the MoE aux term reads it)."""
        return self.token_loss.cp

    def __call__(self, outputs, target) -> torch.Tensor:
        labels, weights, segments, _reference, _index = target
        orpo = self.objective == "orpo"
        sums, counts = segment_sums(self.token_loss, outputs, labels, segments, 3 if orpo else 2)  # [B, 2 or 3]
        weights = weights.to(sums.dtype)
        logps = sums[:, :2] / counts[:, :2].clamp(min=1.0) if self.average else sums[:, :2]  # [B, 2]
        nll_sum = -(sums[:, 0] + sums[:, 2]).sum() if orpo else -sums[:, 0].sum()  # ORPO: prompt + completion
        nll_tokens = (counts[:, 0] + counts[:, 2]).sum() if orpo else counts[:, 0].sum()
        extra: list[torch.Tensor] = []
        if orpo:
            log_odds = (logps[:, 0] - logps[:, 1]) - (log1mexp(logps[:, 0]) - log1mexp(logps[:, 1]))
            ratio = F.logsigmoid(log_odds)
            loss = nll_sum * weights[1] - self.beta * ratio.sum() * weights[0]
            rewards = self.beta * logps
            extra = [ratio.detach().sum(), log_odds.detach().sum()]
        else:
            per_pair = cpo_pair_loss(self.loss_type, self.beta, self.label_smoothing, self.gamma, self.alpha, logps)
            loss = per_pair.sum() * weights[0]
            if self.cpo_alpha != 0.0:  # TRL computes (and logs) no NLL at cpo_alpha = 0
                loss = loss + self.cpo_alpha * nll_sum * weights[1]
            else:
                nll_sum, nll_tokens = nll_sum * 0.0, nll_tokens * 0.0
            rewards = self.beta * cpo_rewards(self.alpha, logps)
        self._add_stats(rewards.detach(), logps.detach(), extra, nll_sum.detach(), nll_tokens)
        return loss / self.cp.size

    def _add_stats(self, rewards: torch.Tensor, logps: torch.Tensor, extra: list[torch.Tensor],
                   nll_sum: torch.Tensor, nll_tokens: torch.Tensor) -> None:
        chosen, rejected = rewards.unbind(-1)
        # STATS' order, then the extra pair sums, the NLL sum and its tokens, the pairs
        sums = torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(), (chosen - rejected).sum(),
                            logps[:, 0].sum(), logps[:, 1].sum(), *extra, nll_sum, nll_tokens,
                            logps.new_tensor(float(len(chosen)))])
        self.stats.add(sums)

    def take_stats(self, device) -> torch.Tensor:
        """This rank's metric sums since the last call (float64: the pair sums of :attr:`names` but
        ``nll_loss``, the NLL sum and its token count, the pair count; zeros on a rank that computed no loss),
        reset."""
        return self.stats.take(device)

    def metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """TRL's metrics from the world's summed :meth:`take_stats`: means over the step's pairs, ``nll_loss``
        the mean over its chosen tokens (0 where no NLL is computed, as TRL logs at ``cpo_alpha=0``). Ranks
        holding the same values (tp, cp) add to numerators and counts alike."""
        pairs = max(float(sums[-1]), 1.0)
        out = {name: float(sums[k]) / pairs for k, name in enumerate(n for n in self.names if n != "nll_loss")}
        tokens = float(sums[-2])
        out["nll_loss"] = float(sums[-3]) / tokens if tokens > 0 else 0.0
        return {name: out[name] for name in self.names}

