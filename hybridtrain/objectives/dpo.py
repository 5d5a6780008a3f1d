"""The preference losses of TRL 1.16's ``DPOTrainer`` over per-sequence log-probabilities, under any layout.

A micro-batch holds whole pairs (:class:`~hybridtrain.data.sampler.PairSamples`: one pair per row, the chosen
then the rejected sequence). The log-probability of a sequence is the sum over its completion tokens of
``log p(label)``, the negative of the per-token loss the vocabulary-parallel cross-entropy computes
(:meth:`~hybridtrain.parallel.layers.VocabParallelLoss.token_losses`, exact under tp), reduced per document
(row x segment). Under context parallelism each rank holds some tokens of every row: the per-document sums
are all-reduced over the cp group (differentiably), so every cp rank forms the same pair losses; it returns
them divided by cp, and the all-reduce's backward hands each rank's tokens the whole gradient, which
DeepSpeed's average over dp x cp turns back into one replica's (``docs/preference.md``).

The returned loss is the micro-batch's summed pair losses times the pair weight of
:meth:`~hybridtrain.data.sampler.PairSamples.batch_weights`, so the step's loss is the mean over the global
batch's pairs, TRL's ``per_sequence_loss.mean()`` over a batch of that size; ``sft`` is the mean token NLL of
the global batch's chosen completions (TRL's over its batch). Formulas: ``DPOTrainer._compute_loss``
(``f_divergence_type=reverse_kl``, no ``ld_alpha``, no ``use_weighting``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hybridtrain.objectives import LOSS_TYPES, STATS  # noqa: F401  (STATS: the metrics this loss sums)
from hybridtrain.objectives.stats import StepSums


def pair_loss(loss_type: str, beta: float, label_smoothing: float, tau: float, logps: torch.Tensor,
              ref: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """TRL's ``per_sequence_loss`` ``[P]`` of ``loss_type`` from ``logps``, ``ref`` and the completion token
    counts ``lengths``, each ``[P, 2]`` (chosen, rejected)."""
    chosen_logratios, rejected_logratios = (logps - ref).unbind(-1)
    delta = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type in ("ipo", "sigmoid_norm"):  # per-token mean log-ratios: normalised by the completion lengths
        average = (logps - ref) / lengths.clamp(min=1.0)
        mean_delta = average[:, 0] - average[:, 1]
        return (mean_delta - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * mean_delta)
    if loss_type == "exo_pair":
        epsilon = torch.tensor(label_smoothing, device=delta.device, dtype=delta.dtype)
        qw, log_qw = torch.sigmoid(beta * delta), F.logsigmoid(beta * delta)
        ql, log_ql = torch.sigmoid(-beta * delta), F.logsigmoid(-beta * delta)
        return qw * (log_qw - torch.log1p(-epsilon)) + ql * (log_ql - torch.log(epsilon))
    if loss_type == "nca_pair":
        chosen, rejected = beta * chosen_logratios, beta * rejected_logratios
        return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)
    if loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * label_smoothing)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
    if loss_type == "sppo_hard":
        return (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return (1 - torch.sigmoid(beta * chosen_logratios)) + torch.sigmoid(beta * rejected_logratios)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * chosen_logratios) + (1 - torch.sigmoid(beta * delta))
    if loss_type == "discopop":
        logits = delta * beta
        modulation = torch.sigmoid(logits / tau)
        return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
    raise ValueError(f"unknown loss type {loss_type!r}; use one of {list(LOSS_TYPES)}")


def segment_sums(token_loss: Any, outputs, labels: torch.Tensor, segments: torch.Tensor,
                 buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums, counts)``, each ``[B, buckets]`` fp32: per row, the summed label log-probabilities (``-``
    ``token_loss.token_losses``, differentiable) and the loss-token counts of the tokens whose ``segments``
    value is ``0 .. buckets - 1`` (-1: padding), over the whole rows: under cp each rank sums its tokens and
    one differentiable all-reduce over the cp group adds the ranks' sums."""
    cp = token_loss.cp
    if cp.size > 1:  # [B, S] -> this rank's tokens [B, S / cp], as the embedding took them
        keep = cp.indices(labels.shape[1], labels.device)
        labels, segments = labels[:, keep], segments[:, keep]
    logp = -token_loss.token_losses(outputs, labels)  # [B, T], 0 at ignored labels
    rows = labels.shape[0]
    doc = (torch.arange(rows, device=labels.device).unsqueeze(1) * buckets + segments).reshape(-1)  # [B x T]
    real = ((segments >= 0) & (labels != -100)).reshape(-1)
    sums = logp.new_zeros(buckets * rows).index_add(0, doc[real], logp.reshape(-1)[real])
    counts = logp.new_zeros(buckets * rows).index_add(0, doc[real], torch.ones_like(logp.reshape(-1)[real]))
    both = torch.stack([sums, counts])  # [2, buckets x B]
    if cp.size > 1:
        from hybridtrain.parallel import collectives

        both = collectives.all_reduce_autograd(both, cp.group)
    return both[0].reshape(rows, buckets), both[1].detach().reshape(rows, buckets)


class PreferenceLoss:
    """The loss function of ``finetune.objective=dpo`` (DeepSpeed's ``loss_fn``: called per micro-batch on the
    last pipeline stage, or by the sequential model), over the target
    ``(labels, weights, segments, reference, index)`` of :class:`~hybridtrain.data.sampler.PairSamples`.

    In ``reference`` mode (:attr:`recording`) it computes only the pairs' log-probabilities and records them
    by pair index (:mod:`hybridtrain.train.preference`); in training it adds each micro-batch's
    :data:`STATS` sums to :attr:`stats` (read and reset by :meth:`take_stats`).
    """

    def __init__(self, token_loss: Any, dpo: Any):
        self.token_loss = token_loss
        self.beta, self.label_smoothing, self.tau = float(dpo.beta), float(dpo.label_smoothing), float(dpo.discopop_tau)
        self.loss_types = [str(t) for t in dpo.loss_type]
        self.loss_weights = [float(w) for w in dpo.loss_weights] if dpo.loss_weights else [1.0] * len(self.loss_types)
        self.recording: list | None = None
        """With a list: reference mode; ``(index [B], logps [B, 2])`` pairs are appended to it."""
        self.stats = StepSums(len(STATS) + 1)
        self.__name__ = "preference_loss"

    @property
    def cp(self):
        """The context-parallel context (the MoE aux term reads it)."""
        return self.token_loss.cp

    def sequence_logps(self, outputs, labels: torch.Tensor,
                       segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logps, lengths)``, each ``[B, 2]`` fp32: the summed completion log-probabilities of each row's
        chosen and rejected sequence and their loss-token counts, over the whole rows (all cp ranks')."""
        return segment_sums(self.token_loss, outputs, labels, segments, 2)

    def __call__(self, outputs, target) -> torch.Tensor:
        labels, weights, segments, reference, index = target
        logps, lengths = self.sequence_logps(outputs, labels, segments)
        if self.recording is not None:
            self.recording.append((index.detach().cpu(), logps.detach().double().cpu()))
            return logps.sum() * 0.0
        ref = reference.to(logps.dtype)
        weights = weights.to(logps.dtype)
        loss = logps.new_zeros(())
        for loss_type, loss_weight in zip(self.loss_types, self.loss_weights):
            if loss_type == "sft":  # the chosen completions' summed NLL, weighted per chosen token of the batch
                loss = loss + loss_weight * (-logps[:, 0].sum()) * weights[1]
            else:
                per_pair = pair_loss(loss_type, self.beta, self.label_smoothing, self.tau, logps, ref, lengths)
                loss = loss + loss_weight * per_pair.sum() * weights[0]
        self._add_stats(logps.detach(), ref)
        return loss / self.cp.size

    def _add_stats(self, logps: torch.Tensor, ref: torch.Tensor) -> None:
        rewards = self.beta * (logps - ref)  # [B, 2]
        chosen, rejected = rewards.unbind(-1)
        sums = torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(), (chosen - rejected).sum(),
                            logps[:, 0].sum(), logps[:, 1].sum(), logps.new_tensor(float(len(chosen)))])
        self.stats.add(sums)

    def take_stats(self, device) -> torch.Tensor:
        """This rank's :data:`STATS` sums and pair count since the last call (``[7]`` float64; zeros on a rank
        that computed no loss), reset."""
        return self.stats.take(device)
