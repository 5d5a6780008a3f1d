"""The rules of ``finetune.objective=reward`` (``docs/preference.md#reward-models``), checked by
:func:`~hybridtrain.plan.validate.build_plan` before anything is read or launched."""
from __future__ import annotations

from typing import Any

from hybridtrain.config.schema import Config
from hybridtrain.errors import PlanError
from hybridtrain.plan.objective import check_pair_rows


def _need(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise PlanError(key, message)


def classifier_class(model_type: str) -> str | None:
    """transformers' ``...ForSequenceClassification`` class name of ``model_type`` (what
    ``AutoModelForSequenceClassification`` builds), or ``None`` where it has none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(model_type)


def check_reward(cfg: Config, family: Any, hf_config: Any) -> None:
    """``finetune.objective=reward`` against the data, the fine-tuning method and the model family."""
    if str(cfg.finetune.objective) != "reward":
        return
    data = cfg.data
    _need(data.format == "preference", "finetune.objective",
          f"reward trains on preference pairs, but data.format={data.format}; set data.format=preference "
          "(records with prompt, chosen and rejected)")
    check_pair_rows(data, "reward")
    _need(str(cfg.finetune.method) != "lora", "finetune.method",
          "lora with finetune.objective=reward is not supported yet (the scalar head would stay frozen and peft's "
          "adapter folder would lack it); use finetune.method=full")
    name = classifier_class(family.model_type)
    _need(name is not None, "finetune.objective",
          f"reward: transformers has no ForSequenceClassification model for model_type {family.model_type!r}, so "
          "no reward model of it could be exported or checked; use a family that has one (llama, qwen2, gpt2, ...)")
    if family.moe is not None and family.moe.aux_enabled(hf_config):
        raise PlanError(f"model.config.{family.moe.aux_on}",
                        f"reward: {name} adds no router load-balancing loss, so a reward model trains without it; "
                        f"set model.config.{family.moe.aux_on}=false")
    _need(not cfg.trainer.save_logits, "trainer.save_logits",
          "a reward model has no logits to save (its head gives one score per token); set trainer.save_logits=false "
          "(an export is checked by its scores: AutoModelForSequenceClassification, docs/preference.md)")
    coefficient = cfg.finetune.reward.center_rewards_coefficient
    _need(coefficient is None or coefficient >= 0, "finetune.reward.center_rewards_coefficient",
          f"must be >= 0 or null (the weight of mean((r_chosen + r_rejected)^2)), got {coefficient}")


def classifier_config(hf_config: Any, pad_id: int) -> Any:
    """A copy of the causal-LM ``hf_config`` as the config of its ``...ForSequenceClassification`` reward model
    (what a reward run's checkpoints and exports write): ``architectures`` that class, ``num_labels=1`` and
    ``pad_token_id`` the data's pad token, by which transformers finds each sequence's last token to pool
    (TRL's ``RewardTrainer`` sets the same on its model)."""
    import copy

    config = copy.deepcopy(hf_config)
    config.architectures = [classifier_class(config.model_type)]
    config.num_labels = 1
    config.pad_token_id = pad_id
    text = config.get_text_config()
    if text is not config:
        text.pad_token_id = pad_id
    return config
