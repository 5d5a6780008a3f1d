"""Mixture-of-experts families at (1, 1, 1), in this process: hybridtrain's model of a tiny
``save_pretrained`` MoE twin (``tests/helpers/moe.py``: routers with a clear top-k margin, the router
load-balancing loss on) gives transformers' logits (fp32, 1e-5 relative), transformers' loss *including*
``router_aux_loss_coef x load_balancing_loss_func`` and its gradients; and the router sums carried through
pipeline stages (:mod:`hybridtrain.models.moe`) give ``load_balancing_loss_func`` however the layers are cut
into stages, which a sum of per-layer terms does not."""
from __future__ import annotations

import pytest
import torch

from helpers.families import SEQ, VOCAB, one_process_model_of
from helpers.moe import MOE_TINY, make_moe_checkpoint, router_margin

TWINS = {"norm": ("qwen3_moe", {}), "no_norm": ("qwen3_moe", {"norm_topk_prob": False}),
         **{family: (family, {}) for family in sorted(MOE_TINY) if family != "qwen3_moe"},
         "deepseek_v3_no_q_lora": ("deepseek_v3", {"q_lora_rank": None})}
"""Each MoE family's twin, Qwen3-MoE's with ``norm_topk_prob`` on (``norm``) and off, and DeepSeek-V3's without
the low-rank query (``q_lora_rank=None``: one ``q_proj``)."""

NO_AUX = {"deepseek_v3"}
"""Families whose transformers loss has no router load-balancing term."""

GRADS = {
    "deepseek_v3": ["model.layers.1.mlp.gate.weight", "model.layers.3.mlp.gate.weight",
                    "model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.shared_experts.down_proj.weight",
                    "model.layers.0.mlp.gate_proj.weight", "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
                    "model.layers.2.self_attn.kv_a_layernorm.weight", "model.layers.2.self_attn.kv_b_proj.weight"],
    "qwen3_5_moe_text": ["model.layers.0.mlp.gate.weight", "model.layers.3.mlp.gate.weight",
                         "model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.shared_expert.down_proj.weight",
                         "model.layers.0.mlp.shared_expert_gate.weight", "model.layers.3.self_attn.q_proj.weight",
                         "model.layers.2.linear_attn.in_proj_qkv.weight", "model.layers.2.linear_attn.conv1d.weight",
                         "model.layers.1.linear_attn.A_log", "model.layers.0.linear_attn.norm.weight"],
    "qwen3_next": ["model.layers.0.mlp.gate.weight", "model.layers.3.mlp.gate.weight",
                   "model.layers.2.mlp.experts.gate_up_proj", "model.layers.0.mlp.shared_expert.down_proj.weight",
                   "model.layers.1.mlp.down_proj.weight", "model.layers.3.self_attn.q_proj.weight",
                   "model.layers.2.linear_attn.in_proj_qkvz.weight", "model.layers.1.linear_attn.in_proj_ba.weight",
                   "model.layers.2.linear_attn.conv1d.weight", "model.layers.0.linear_attn.dt_bias"],
}
"""The gradients checked of a family whose blocks are not named like Qwen3-MoE's (DeepSeek-V3: block 0 dense;
Qwen3.5-MoE and Qwen3-Next: blocks 0-2 Gated DeltaNet, block 3 full attention; Qwen3-Next's block 1 dense)."""


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory):
    """The :data:`TWINS` as ``save_pretrained`` folders (read only)."""
    root = tmp_path_factory.mktemp("moe")
    return {name: make_moe_checkpoint(root / name, family, **extra) for name, (family, extra) in TWINS.items()}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(1, VOCAB, (2, SEQ), generator=gen), torch.randint(1, VOCAB, (2, SEQ), generator=gen)


def _transformers(folder, **config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **config)


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1]).expand_as(ids)


@pytest.mark.parametrize("which", list(TWINS))
def test_logits_equal_transformers(which, moe_folders):
    ids, _ = _batch()
    assert router_margin(moe_folders[which], ids) > 1e-4  # no top-k choice near a tie
    with torch.no_grad():
        want = _transformers(moe_folders[which]).eval()(input_ids=ids).logits
        got = one_process_model_of(moe_folders[which]).eval().logits(ids)
    assert got.shape == want.shape == (2, SEQ, VOCAB)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 1e-5 * scale


LOSS_CASES = {"norm": (), "norm_checkpointed": ("parallel.activation_checkpointing=true",),
              **{family: () for family in TWINS if family not in ("norm", "no_norm")}}


def _family(which: str) -> str:
    return TWINS[which][0]


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_loss_and_router_grads_include_the_aux_loss(case, moe_folders):
    """transformers' ``loss`` (cross-entropy + 0.02 x aux) and the gradients it gives every router and expert."""
    overrides, which = LOSS_CASES[case], case.split("_checkpointed")[0]
    ids, labels = _batch()
    hf = _transformers(moe_folders[which]).train()
    out = hf(input_ids=ids, labels=labels, shift_labels=labels)
    if _family(which) in NO_AUX:  # transformers' loss is the cross-entropy alone, and so is ours
        assert out.aux_loss is None
    else:
        assert out.aux_loss is not None and out.aux_loss.item() > 1.0  # the term is there and not negligible
    out.loss.backward()
    ours = one_process_model_of(moe_folders[which], *overrides).train()
    loss = ours((ids, _positions(ids)), labels)
    loss.backward()
    assert loss.item() == pytest.approx(out.loss.item(), rel=1e-6)
    grads = {n: p.grad for n, p in hf.named_parameters()}
    got = {name: p.grad for layer in ours.layers[1:-1] for name, p, _ in layer.hf_params()}
    router = "router" if which == "gpt_oss" else "gate"
    names = [f"model.layers.0.mlp.{router}.weight", f"model.layers.3.mlp.{router}.weight",
             "model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.self_attn.q_proj.weight"]
    if which == "gpt_oss":  # the biases of router, experts and attention, and the attention sinks
        names += ["model.layers.0.mlp.router.bias", "model.layers.1.mlp.experts.gate_up_proj_bias",
                  "model.layers.1.mlp.experts.down_proj_bias", "model.layers.2.self_attn.sinks",
                  "model.layers.3.self_attn.o_proj.bias"]
    if which == "qwen2_moe":  # the gated shared expert
        names += ["model.layers.0.mlp.shared_expert_gate.weight", "model.layers.2.mlp.shared_expert.down_proj.weight"]
    names = list(GRADS.get(_family(which), names))
    if which == "deepseek_v3":
        names += ["model.layers.2.self_attn.q_a_proj.weight", "model.layers.2.self_attn.q_b_proj.weight"]
    elif which == "deepseek_v3_no_q_lora":
        names += ["model.layers.2.self_attn.q_proj.weight"]
    for name in names:
        scale = grads[name].abs().max().item()
        assert (got[name] - grads[name]).abs().max().item() <= 1e-5 * scale, name


def test_without_router_logits_the_loss_is_the_cross_entropy(moe_folders):
    ids, labels = _batch()
    want = _transformers(moe_folders["norm"], output_router_logits=False)(input_ids=ids, labels=labels,
                                                                           shift_labels=labels).loss
    ours = one_process_model_of(moe_folders["norm"], "+model.config.output_router_logits=false")
    got = ours((ids, _positions(ids)), labels)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    with_aux = one_process_model_of(moe_folders["norm"])((ids, _positions(ids)), labels)
    assert with_aux.item() - got.item() > 0.01  # 0.02 x aux (about 2) apart


@pytest.mark.parametrize("cuts", [(4,), (1, 3), (2, 2), (1, 1, 2)], ids=str)
def test_carried_sums_give_load_balancing_loss_func_over_any_stages(cuts):
    """Four layers' router logits cut into stages: each stage adds its layers to the carried ``(P, C)``,
    the last forms the term: transformers' value (1e-7), value and gradient; a mean of per-layer terms
    (DeepSpeed's, Megatron's) is another number."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from hybridtrain.models.moe import layer_sums, load_balancing

    experts, k, tokens = 8, 2, 64
    logits = [(torch.randn(tokens, experts, generator=torch.Generator().manual_seed(i)) * 2).requires_grad_()
              for i in range(4)]
    want = load_balancing_loss_func(tuple(logits), experts, k)
    (want_grad,) = torch.autograd.grad(want, logits[1])
    p_sum, counts = torch.zeros(experts), torch.zeros(experts, dtype=torch.int64)
    first = 0
    for size in cuts:  # one stage: its layers' sums join the carried ones
        for layer in logits[first:first + size]:
            p, c = layer_sums(layer, k)
            p_sum, counts = p_sum + p, counts + c
        first += size
    got = load_balancing(p_sum, counts, float(len(logits) * tokens))
    assert got.item() == pytest.approx(want.item(), rel=1e-7)
    (got_grad,) = torch.autograd.grad(got, logits[1])
    assert torch.allclose(got_grad, want_grad, rtol=1e-6, atol=1e-9)
    per_layer = sum(load_balancing_loss_func((layer,), experts, k) for layer in logits) / len(logits)
    assert abs(per_layer.item() - want.item()) > 1e-4


def test_deepseek_v3_reads_its_routing_bias_and_has_no_aux_loss(moe_folders):
    """DeepSeek-V3's ``e_score_correction_bias`` (a buffer, no gradient) is read from the checkpoint (the twin's is
    not zero, and the choice depends on it: zeroing it changes transformers' logits), kept fp32, and hands back
    among the tensors a checkpoint writes; ``output_router_logits`` adds no term to the loss (transformers adds none)."""
    from safetensors import safe_open

    folder = moe_folders["deepseek_v3"]
    ours = one_process_model_of(folder)
    buffers = dict(x for layer in ours.layers[1:-1] for x in layer.hf_buffers())
    assert sorted(buffers) == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2, 3)]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name, value in buffers.items():
            assert value.dtype == torch.float32 and torch.equal(value, f.get_tensor(name)) and value.abs().max() > 0
    ids, labels = _batch()
    hf = _transformers(folder).eval()
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        assert (hf(input_ids=ids).logits - want).abs().max() > 1e-3
    plain = one_process_model_of(folder)((ids, _positions(ids)), labels)
    with_flag = one_process_model_of(folder, "+model.config.output_router_logits=true")((ids, _positions(ids)), labels)
    assert with_flag.item() == plain.item()


def test_the_router_sums_read_nothing_to_the_host_and_count_as_bincount():
    """gpu-review-3 finding 2: the aux loss's per-layer ``(P, C)`` (``models.moe.layer_sums``) counts the top-k
    choices without ``bincount`` (whose CUDA kernel reads min and max to the host): no syncing call
    (tests/helpers/syncs.py), and the same counts, experts never chosen included."""
    import torch

    from helpers.syncs import HostSyncs
    from hybridtrain.models.moe import layer_sums

    torch.manual_seed(0)
    logits = torch.randn(2, 7, 8)
    logits[..., 5] = -30.0  # expert 5 is never chosen
    with HostSyncs() as syncs:
        p_sum, counts = layer_sums(logits, 2)
    assert syncs.calls == []
    chosen = torch.topk(torch.softmax(logits.reshape(-1, 8), dim=-1), 2, dim=-1).indices
    assert torch.equal(counts, torch.bincount(chosen.reshape(-1), minlength=8)) and counts[5] == 0
    assert counts.dtype == torch.int64 and p_sum.dtype == torch.float32
