"""``finetune.objective=dpo``: the plan's refusals (``hybridtrain.plan.objective``, through ``build_plan``), the
LoRA reference switch and the per-sequence log-probabilities of the preference loss."""
from __future__ import annotations

import math

import pytest
import torch

from hybridtrain.plan import PlanError, resolve
from hybridtrain.plan.machine import machine_facts

from helpers.config import compose

DPO = ("data.format=preference", "finetune.objective=dpo")


@pytest.mark.parametrize("overrides,key,fragment", [
    pytest.param(("finetune.objective=dpo",), "finetune.objective",
                 "dpo trains on preference pairs, but data.format=text", id="dpo_without_pairs"),
    pytest.param(("data.format=preference",), "data.format", "preference pairs train only with finetune.objective=dpo",
                 id="pairs_without_dpo"),
    pytest.param(DPO + ("data.packing=none",), "data.packing", "a preference pair is one row of its two sequences",
                 id="pairs_unpacked"),
    pytest.param(DPO + ("data.val_fraction=0.1",), "data.val_fraction",
                 "validation of finetune.objective=dpo is not supported yet", id="validation"),
    pytest.param(DPO + ("finetune.dpo.loss_type=[sigmoid,aot]",), "finetune.dpo.loss_type",
                 "is not a list of TRL loss types", id="unknown_loss_type"),
    pytest.param(DPO + ("finetune.dpo.loss_type=[sigmoid,sft]", "finetune.dpo.loss_weights=[1.0]"),
                 "finetune.dpo.loss_weights", "has 1 weights for the 2 loss types", id="weights_count"),
    pytest.param(DPO + ("finetune.dpo.beta=0",), "finetune.dpo.beta", "must be > 0", id="beta"),
    pytest.param(DPO + ("finetune.dpo.label_smoothing=0.5",), "finetune.dpo.label_smoothing",
                 "robust divides by 1 - 2 x it", id="smoothing"),
    pytest.param(DPO + ("finetune.dpo.loss_type=[exo_pair]",), "finetune.dpo.label_smoothing",
                 "exo_pair takes log(label_smoothing)", id="exo_pair_without_smoothing"),
])
def test_the_plan_refuses_what_dpo_cannot_run(overrides, key, fragment):
    with pytest.raises(PlanError) as info:
        resolve(compose("+recipe=gpt_tiny", *overrides), machine_facts())
    assert info.value.key == key and fragment in str(info.value)


def test_the_dpo_recipe_plans():
    plan, _ = resolve(compose("+recipe=dpo"), machine_facts())
    assert (plan.global_batch_size, plan.micro_batch_size, plan.grad_accum) == (8, 4, 2)


def test_adapters_off_gives_the_base_layer_exactly():
    from hybridtrain.parallel.context import TPContext
    from hybridtrain.parallel.layers import ColumnParallelLinear
    from hybridtrain.parallel.lora import LoraColumnParallelLinear, adapters_off

    torch.manual_seed(0)
    base = ColumnParallelLinear(torch.randn(6, 4), torch.randn(6))
    layer = LoraColumnParallelLinear(base, torch.randn(2, 4), torch.randn(6, 2), scaling=2.0, dropout=0.0,
                                     tp=TPContext())
    x = torch.randn(3, 4)
    with adapters_off(torch.nn.Sequential(layer)):
        assert torch.equal(layer(x), base(x))
    assert not torch.allclose(layer(x), base(x)) and layer.scaling == 2.0  # back on


def test_sequence_logps_are_per_document_sums_of_the_label_log_probs():
    """The preference loss's log-probability of each row's chosen and rejected sequence is the sum of
    ``log softmax(logits)[label]`` over that sequence's loss tokens (prompt and padding excluded)."""
    from hybridtrain.objectives.dpo import PreferenceLoss
    from hybridtrain.parallel.context import TPContext
    from hybridtrain.parallel.layers import VocabParallelLoss
    from hybridtrain.config.schema import DPOConfig

    torch.manual_seed(1)
    logits = torch.randn(2, 7, 11)
    labels = torch.tensor([[-100, 3, 4, -100, 5, 6, -100], [-100, -100, 1, -100, 2, -100, -100]])
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, -1], [0, 0, 0, 1, 1, -1, -1]])
    loss = PreferenceLoss(VocabParallelLoss(11, TPContext()), DPOConfig())
    logps, lengths = loss.sequence_logps(logits, labels, segments)
    lp = torch.log_softmax(logits, -1)
    want = torch.tensor([[lp[0, 1, 3] + lp[0, 2, 4], lp[0, 4, 5] + lp[0, 5, 6]], [lp[1, 2, 1], lp[1, 4, 2]]])
    assert torch.allclose(logps, want, atol=1e-6) and lengths.tolist() == [[2.0, 2.0], [1.0, 1.0]]
    reference = logps.detach().double()  # the policy is its reference: every sigmoid pair loss is log 2
    weights = torch.tensor([1.0 / 2, 1.0 / 3])  # one step of these two pairs, one micro-batch
    out = loss(logits, (labels, weights, segments, reference, torch.arange(2)))
    assert out.item() == pytest.approx(math.log(2))


def test_a_resumed_run_whose_reference_is_gone_stops(tmp_path):
    """After a checkpoint's weights were loaded the initial model is gone: no reference is computed from them."""
    from types import SimpleNamespace

    from hybridtrain.train.preference import attach_reference

    cfg = compose("+recipe=dpo")
    samples = SimpleNamespace(reference=None, num_samples=4)
    with pytest.raises(RuntimeError, match="are gone and the weights loaded are a checkpoint's"):
        attach_reference(cfg, SimpleNamespace(precision="fp32"), None, samples, str(tmp_path), initial_weights=False,
                         is_rank0=True)
    assert samples.reference is None
