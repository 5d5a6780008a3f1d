"""Tiny mixture-of-experts twins for the MoE tests: ``save_pretrained`` folders of random models whose
routers have a clear margin between every token's k-th and (k+1)-th expert, so that the rounding of
another layout (about 1e-7 relative in fp32) cannot flip a choice, and with the router load-balancing
loss on (``output_router_logits``) so that the loss carries it."""
from __future__ import annotations

from pathlib import Path

from helpers.families import VOCAB

MOE_TINY: dict[str, dict] = {
    "qwen3_moe": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                      intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      max_position_embeddings=128, norm_topk_prob=True, output_router_logits=True,
                      router_aux_loss_coef=0.02),
    "deepseek_v3": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=128),
    "mixtral": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                    intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
                    sliding_window=8, output_router_logits=True, router_aux_loss_coef=0.02),
    "olmoe": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=32, num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
                  output_router_logits=True, router_aux_loss_coef=0.02, pad_token_id=1),
    "qwen2_moe": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64, intermediate_size=128,
                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=128, output_router_logits=True,
                      router_aux_loss_coef=0.02),
    "gpt_oss": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                    intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    output_router_logits=True, router_aux_loss_coef=0.02),
    "qwen3_5_moe_text": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                             head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
                             num_experts_per_tok=2, max_position_embeddings=128, linear_num_key_heads=4,
                             linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=8,
                             output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=False),
    "qwen3_next": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                       intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                       num_experts=8, num_experts_per_tok=2, max_position_embeddings=128, linear_num_key_heads=4,
                       linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=8, mlp_only_layers=[1],
                       output_router_logits=True, router_aux_loss_coef=0.02),
}
"""``model.config`` of each MoE family's twin (HF names): 8 experts, top-2, widths divisible by 4; Qwen3-MoE
renormalises the top-k weights (``norm_topk_prob``), OLMoE and Qwen2-MoE do not (their default), Mixtral always
does; Mixtral with a sliding window, Qwen2-MoE with its gated shared expert; gpt-oss with alternating sliding (window
8) and full layers, biases everywhere and attention sinks (all nonzero: every weight gets noise). DeepSeek-V3: MLA
attention (q and kv low-rank, a value head narrower than the query/key head), a dense block 0
(``first_k_dense_replace``), the group-limited sigmoid router (4 groups of 2 experts, the best 2 groups), one shared
expert; transformers gives it no router aux loss."""

ROUTER_SCALE = 4.0
"""The routers' weights are multiplied by this after the noise: router logits spread over about one unit
(random routers at HF's init route almost uniformly, which would hide a wrong dispatch)."""

ROUTERS = ("mlp.gate.weight", "mlp.router.weight")
"""The router weights' names (gpt-oss calls its router ``mlp.router``; its bias is not scaled)."""

BIAS_SCALE = 0.1
"""DeepSeek-V3's ``e_score_correction_bias`` (zero at HF's init) is drawn with this spread: it shifts the choice
among sigmoid scores a few tenths apart, so a checkpoint that lost it routes differently."""


def moe_config(family: str, **extra):
    """The tiny HF config of MoE ``family`` with the embedded tokenizer's vocabulary and EOS id."""
    from transformers import AutoConfig

    return AutoConfig.for_model(family, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
                                **{**MOE_TINY[family], **extra})


SEEDS = {"deepseek_v3": 2}
"""A family's twin seed where the default (7) leaves a routing choice near a tie: DeepSeek-V3 makes two choices
per token (groups, then experts in them), and seed 7's closest is 7e-5 apart (:func:`router_margin`), seed 2's 4e-4."""


def make_moe_checkpoint(folder: Path, family: str, seed: int | None = None, **extra) -> Path:
    """``save_pretrained`` of a random tiny MoE ``family`` model (perturbed weights, scaled routers) plus the
    embedded tokenizer; ``seed`` ``None``: the family's (:data:`SEEDS`, else 7)."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers.finetune import save_tokenizer

    torch.manual_seed(SEEDS.get(family, 7) if seed is None else seed)
    model = AutoModelForCausalLM.from_config(moe_config(family, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
            if name.endswith(ROUTERS):
                p.mul_(ROUTER_SCALE)
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias: its choice must depend on it
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * BIAS_SCALE)
    model.save_pretrained(str(folder))
    save_tokenizer(folder)
    return folder


def router_margin(folder: Path, ids) -> float:
    """The smallest gap, over every token and MoE layer of transformers' forward of ``ids``, between the
    k-th and (k+1)-th router logit, relative to the largest router logit."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    k = int(model.config.num_experts_per_tok)
    if model.config.model_type == "deepseek_v3":
        routers = [m for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
        return min(_group_limited_margin(logits, router) for logits, router in zip(out.router_logits, routers))
    gaps = []
    for logits in out.router_logits:  # [T, E]; softmax keeps the order, so the choice is the logits' top-k
        top = torch.topk(logits.float(), k + 1, dim=-1).values  # [T, k + 1]
        gaps.append((top[:, k - 1] - top[:, k]).min() / logits.abs().max())
    return float(torch.stack(gaps).min())


def twin_maker(root: Path):
    """``get(family)``: each MoE family's tiny checkpoint under ``root`` (:func:`make_moe_checkpoint`), made on
    first use (a module fixture's factory)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_moe_checkpoint(root / family, family)
        return made[family]

    return get


def moe_overrides(folder: Path, steps: int, *extra: str) -> list[str]:
    """The CLI overrides of an MoE fine-tune of ``folder`` the MoE tests share: the finetune recipe, rows of
    ``helpers.families.SEQ`` tokens, a global batch of 8, ``steps`` steps at lr 1e-3 after one warmup step."""
    from helpers.families import SEQ

    return ["+recipe=finetune", f"model.pretrained={folder}", f"data.seq_len={SEQ}", "trainer.global_batch_size=8",
            f"trainer.max_steps={steps}", "optim.lr=1e-3", "optim.warmup_steps=1", *extra]


def _group_limited_margin(logits, router) -> float:
    """DeepSeek-V3's choice (``DeepseekV3TopkRouter``): scores ``sigmoid(logits) + e_score_correction_bias``, the
    best ``topk_group`` groups by the sum of each group's two best scores, then the top-k scores inside them. The
    smaller of the two gaps (the last chosen group vs the next, the k-th chosen score vs the next one allowed),
    relative to the largest score."""
    import torch

    scores = logits.float().sigmoid() + router.e_score_correction_bias  # [T, E]
    tokens, experts = scores.shape
    groups = scores.view(tokens, router.num_group, experts // router.num_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
    top_groups = torch.topk(groups, router.topk_group + 1, dim=-1)  # [T, topk_group + 1]
    group_gap = top_groups.values[:, -2] - top_groups.values[:, -1]
    allowed = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, top_groups.indices[:, :-1], True)
    allowed = allowed.repeat_interleave(experts // router.num_group, dim=1)  # [T, E]
    inside = torch.topk(scores.masked_fill(~allowed, float("-inf")), router.top_k + 1, dim=-1).values
    expert_gap = inside[:, -2] - inside[:, -1]
    return float(torch.minimum(group_gap, expert_gap).min() / scores.abs().max())
