"""The plan's mixture-of-experts rules (``hybridtrain/plan/moe.py``): ``parallel.ep`` and what MoE models
cannot do yet are refused before anything starts, each naming its key."""
from __future__ import annotations

import pytest

from helpers.config import compose
from hybridtrain.plan import Machine, PlanError, resolve

CPU = Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=4)

TINY_MOE = ("+recipe=llama_tiny", "model=qwen3_moe", "model.config.hidden_size=64", "model.config.num_hidden_layers=2",
            "model.config.num_attention_heads=8", "model.config.num_key_value_heads=4", "+model.config.head_dim=16",
            "+model.config.num_experts=8", "+model.config.moe_intermediate_size=32",
            "+model.config.num_experts_per_tok=2", "model.config.intermediate_size=128",
            "~model.config.tie_word_embeddings")
"""A two-block Qwen3-MoE (8 experts, top-2) on the llama_tiny recipe."""


def _error(*overrides: str) -> PlanError:
    with pytest.raises(PlanError) as info:
        resolve(compose(*overrides), CPU)
    return info.value


CASES = {  # id -> (overrides, key, fragments of the message)
    "ep_on_a_dense_model": (("+recipe=llama_tiny", "parallel.dp=2", "parallel.ep=2"), "parallel.ep",
                            ["parallel.ep=2: llama is a dense model", "use parallel.ep=1"]),
    "ep_not_supported_yet": ((*TINY_MOE, "parallel.dp=2", "parallel.ep=2"), "parallel.ep",
                             ["expert parallelism is not supported yet"]),
    "ep_below_one": ((*TINY_MOE, "parallel.ep=0"), "parallel.ep", ["must be >= 1, got 0"]),
    "dense_blocks": ((*TINY_MOE, "+model.config.mlp_only_layers=[0]"), "model.config.mlp_only_layers",
                     ["blocks [0] of this qwen3_moe model have a dense MLP", "not supported yet"]),
    "packing_with_aux": ((*TINY_MOE, "+model.config.output_router_logits=true", "data.packing=documents"),
                         "data.packing", ["with the router aux loss on", "model.config.output_router_logits=false"]),
    "tp_not_dividing_the_experts": ((*TINY_MOE, "model.config.moe_intermediate_size=36", "parallel.tp=8"), "parallel.tp",
                                    ["must divide model.config.moe_intermediate_size=36"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_rule_names_the_key(case):
    overrides, key, fragments = CASES[case]
    err = _error(*overrides)
    assert err.key == key, str(err)
    for fragment in fragments:
        assert fragment in str(err), (fragment, str(err))


def test_an_moe_model_plans():
    plan, hf_config = resolve(compose(*TINY_MOE, "parallel.tp=2", "parallel.pp=2"), CPU)
    assert plan.dims.tp == 2 and plan.dims.pp == 2 and hf_config.num_experts == 8
