"""``model.family=auto``: the adapter derived from transformers' plans, and its self-check at tp = 1
(tp = 2 spawns ranks: tests/dist/test_family_auto_cli.py)."""
from __future__ import annotations

import pytest

from hybridtrain.models.families import get_family
from hybridtrain.models.families.auto import NotDerivable, derive


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"])
def test_derived_adapter_equals_the_verified_family(model_type):
    derived, verified = derive(model_type), get_family(model_type)
    for key in ("embed", "blocks", "final_norm", "head", "rotary_embed", "attention", "embed_scale",
                "final_logit_softcap", "kv_heads"):
        assert getattr(derived, key) == getattr(verified, key), key
    # FlashAttention 2 (packed records' varlen kernels) only for verified families: the self-check runs on CPU
    assert derived.attn_implementations == tuple(a for a in verified.attn_implementations if a != "flash_attention_2")
    assert derived.tp_plan == verified.tp_plan
    assert set(derived.input_copy) == set(verified.input_copy)


@pytest.mark.parametrize("model_type,fragment", [
    ("phi3", "not a Megatron split"), ("olmo2", "not a Megatron split"), ("gpt2", "ships no base_model_tp_plan")])
def test_what_the_plans_cannot_describe_is_refused(model_type, fragment):
    with pytest.raises(NotDerivable, match=fragment):
        derive(model_type)


def _self_check_tp1(model_type: str, **config) -> float:
    from transformers import AutoConfig

    from hybridtrain.models.selfcheck import self_check

    family = derive(model_type)
    hf = AutoConfig.for_model(model_type, **config)
    hf._attn_implementation = family.attn_implementations[0]
    return self_check(family, hf, tps=(1,))[1]


@pytest.mark.parametrize("model_type", ["helium", "smollm3", "starcoder2", "olmo"])
def test_self_check_passes_a_model_the_plans_describe(model_type):
    assert _self_check_tp1(model_type) <= 1e-5


@pytest.mark.parametrize("model_type,config", [
    ("cohere", {}),  # logits scaled in the causal-LM head (logit_scale)
    ("granite", {"embedding_multiplier": 12.0, "logits_scaling": 8.0}),  # multipliers outside the blocks
    ("phi", {}),  # Phi-1/2: an LM head with a bias (Linear(hidden, vocab, bias=True))
])
def test_self_check_catches_model_level_operations(model_type, config):
    from hybridtrain.models.selfcheck import TOLERANCE

    assert _self_check_tp1(model_type, **config) > 100 * TOLERANCE


def test_unverified_model_type_is_refused_naming_the_list_and_auto():
    from hybridtrain.errors import PlanError
    from hybridtrain.plan.hf import checked_family

    from helpers.config import compose

    cfg = compose("+recipe=gpt_tiny", "model.model_type=helium", "model.config={}")
    with pytest.raises(PlanError) as err:
        checked_family(cfg)
    assert err.value.key == "model.model_type" and "'gpt2'" in str(err.value) and "model.family=auto" in str(err.value)
    cfg.model.family = "auto"
    assert checked_family(cfg).model_type == "helium"


def test_a_config_transformers_cannot_run_is_named_not_blessed():
    """Helium's o_proj maps hidden -> hidden: a head_dim that does not fit hidden / heads breaks
    transformers' own forward; the twin keeps that ratio, so the check reports it."""
    from transformers import AutoConfig

    from hybridtrain.models.selfcheck import TwinFailed, self_check

    family = derive("helium")
    hf = AutoConfig.for_model("helium", hidden_size=96, num_attention_heads=12, num_key_value_heads=6, head_dim=128)
    hf._attn_implementation = "sdpa"
    with pytest.raises(TwinFailed, match="transformers' own forward fails"):
        self_check(family, hf, tps=(1,))
