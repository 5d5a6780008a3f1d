"""Model FLOPs per unit against the closed forms of the MFU literature."""
from transformers import GPT2Config, LlamaConfig

from hybridtrain.models.families import GPT2, LLAMA
from hybridtrain.models.hf_model import meta_model
from hybridtrain.models.shapes import linear_flops
from hybridtrain.models.units import model_units
from hybridtrain.plan.flops import model_flops_per_token, unit_forward_flops


def test_gpt2_matches_6n_plus_attention():
    # PaLM appendix B: 6N + 12 L h s per token, N = non-embedding params (12 L h^2) + head (h V).
    L, h, s, V = 12, 768, 1024, 50304
    cfg = GPT2Config(n_layer=L, n_embd=h, n_head=12, n_positions=s, vocab_size=V)
    assert model_flops_per_token(GPT2, cfg, s, V) == 6 * (12 * L * h * h + h * V) + 12 * L * h * s


def test_llama_block_counts_grouped_kv_and_gated_mlp():
    h, heads, kv, f, s = 512, 8, 2, 1376, 256
    cfg = LlamaConfig(hidden_size=h, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=f, num_hidden_layers=2, vocab_size=1000)
    kv_dim = kv * h // heads
    expected = 2 * h * (h + 2 * kv_dim) + 2 * h * h + 4 * s * h + 3 * 2 * h * f
    units = {u.name: u for u in model_units(LLAMA, cfg)}
    block = meta_model(cfg).get_submodule("model.layers.0")
    assert unit_forward_flops(units["block.1"], LLAMA, cfg, s, 1000, linear_flops(block)) == expected
    assert unit_forward_flops(units["embed"], LLAMA, cfg, s, 1000) == 0
    assert unit_forward_flops(units["head"], LLAMA, cfg, s, 1024) == 2 * h * 1024
