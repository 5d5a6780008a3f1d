"""Training objectives other than the token cross-entropy: the preference losses of ``finetune.objective=dpo``
(:mod:`hybridtrain.objectives.dpo`), the reference-free ones of ``cpo`` and ``orpo``
(:mod:`hybridtrain.objectives.reference_free`) and the reward model's loss of ``finetune.objective=reward``
(:mod:`hybridtrain.objectives.reward`)."""
from __future__ import annotations

PAIR_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
               "apo_down", "discopop", "sigmoid_norm")
"""TRL's per-pair loss types (each needs the reference log-probabilities)."""
LOSS_TYPES = PAIR_LOSSES + ("sft",)
"""Every ``finetune.dpo.loss_type`` name (TRL's ``aot`` and ``aot_unpaired`` sort over the batch, which a
micro-batch cut would change: not offered)."""
STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
         "logps/rejected")
"""The per-step metrics, TRL's names: means over the step's pairs."""
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
"""TRL's ``CPOConfig.loss_type`` names (``alphapo`` is TRL's shorthand for ``simpo`` with ``cpo_alpha=0``)."""
CPO_STATS = STATS + ("nll_loss",)
"""``finetune.objective=cpo``'s per-step metrics, TRL's ``CPOTrainer`` names (``logits/*``: not kept)."""
ORPO_STATS = STATS + ("nll_loss", "log_odds_ratio", "log_odds_chosen")
"""``finetune.objective=orpo``'s per-step metrics, TRL's ``ORPOTrainer`` names (``logits/*``: not kept)."""
