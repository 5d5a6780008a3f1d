"""One tiny config per model family, each exercising its family's traps, and the checkpoints made
from them with ``save_pretrained`` (random weights, perturbed so masks, caps, norms and biases matter).

Every config has 8 query heads (4 KV heads where the family has grouped-query attention) and MLP
widths divisible by 4, so tp in {1, 2, 4} divides them; the vocabulary is the embedded tokenizer's
(8000 tokens) so the checkpoints train on the embedded corpus through the real CLI.
"""
from __future__ import annotations

from pathlib import Path

VOCAB = 8000
SEQ = 32
"""Sequence length of the tests: longer than every sliding window below."""

TINY: dict[str, dict] = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=8, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=128, max_position_embeddings=128),
    "mistral": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
                    intermediate_size=128, max_position_embeddings=128, sliding_window=8),
    "qwen2": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=128, max_position_embeddings=128, use_sliding_window=True, sliding_window=8,
                  max_window_layers=2, tie_word_embeddings=True),
    "qwen3": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                  intermediate_size=128, max_position_embeddings=128, attention_bias=True, use_sliding_window=True,
                  sliding_window=8, max_window_layers=2),
    "gemma": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                  intermediate_size=128, max_position_embeddings=128, pad_token_id=0),
    "gemma2": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                   intermediate_size=128, max_position_embeddings=128, query_pre_attn_scalar=32, sliding_window=8,
                   attn_logit_softcapping=2.0, final_logit_softcapping=1.0, pad_token_id=0),
    "phi3": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=128, max_position_embeddings=128, pad_token_id=0, sliding_window=8,
                 resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, partial_rotary_factor=0.5),
    "olmo2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=128, max_position_embeddings=128, pad_token_id=1),
    "gpt_neox": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, intermediate_size=128,
                     max_position_embeddings=128, rotary_pct=0.25, use_parallel_residual=True, hidden_dropout=0.0,
                     attention_dropout=0.0),
    "qwen3_5_text": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                         intermediate_size=128, max_position_embeddings=128, linear_num_key_heads=4,
                         linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=8,
                         linear_conv_kernel_dim=4, tie_word_embeddings=False),
    "smollm3": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                    intermediate_size=128, max_position_embeddings=128, no_rope_layer_interval=2,
                    use_sliding_window=True, sliding_window=8, pad_token_id=2),
    "olmo3": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=128, max_position_embeddings=128, sliding_window=8, pad_token_id=1,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}),
    "gemma3_text": dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                        intermediate_size=128, max_position_embeddings=128, query_pre_attn_scalar=32, sliding_window=8,
                        pad_token_id=0),
}
"""``model.config`` of each family's tiny twin (HF names). Qwen3.5's: blocks 0-2 Gated DeltaNet with two value heads
per key head and value heads narrower than key heads (a mixed-up q | k | v split shows), block 3 gated full
attention with partial rotary (transformers' defaults: ``layer_types`` 3:1, ``partial_rotary_factor`` 0.25).
SmolLM3's: NoPE on blocks 1 and 3 (``no_rope_layer_interval=2``), which are also its sliding-window blocks
(transformers puts windows on NoPE layers only). OLMo 3's: blocks 0-2 sliding, block 3 full, each type its own rotary
base. Gemma 3's: blocks 0-4 sliding and block 5 global (transformers' 5:1 default), rotary bases 1e4 (sliding) and 1e6
(global, transformers' defaults), ``query_pre_attn_scalar`` apart from ``head_dim``."""

NOISE = {"gemma2": 0.1}
"""Standard deviation of the noise added to every weight (default 0.05): enough that Gemma 2's logit caps bind."""


def hf_config(family: str, **extra):
    """The tiny HF config of ``family`` with the embedded tokenizer's vocabulary and EOS id."""
    from transformers import AutoConfig

    return AutoConfig.for_model(family, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, **{**TINY[family], **extra})


def make_family_checkpoint(folder: Path, family: str, seed: int = 7, **extra) -> Path:
    """``save_pretrained`` of a random tiny ``family`` model (perturbed weights) plus the embedded tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers.finetune import save_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **extra))
    with torch.no_grad():  # norms at 1 (or 0) and biases at 0 would hide a dropped or mis-sliced term
        for p in model.parameters():
            p.add_(torch.randn_like(p) * NOISE.get(family, 0.05))
    model.save_pretrained(str(folder))
    save_tokenizer(folder)
    return folder


def one_process_model_of(folder: Path, *overrides: str):
    """hybridtrain's one-process model (tp = 1, :func:`hybridtrain.models.stages.one_process_model`) of the
    pretrained folder ``folder``, configured as ``+recipe=finetune model.pretrained=FOLDER OVERRIDES``
    composes it for a run."""
    from helpers.config import compose
    from hybridtrain.models.stages import one_process_model
    from hybridtrain.plan import apply_pretrained_defaults, model_config

    cfg = compose("+recipe=finetune", f"model.pretrained={folder}", *overrides)
    apply_pretrained_defaults(cfg)
    return one_process_model(cfg, model_config(cfg))
