"""Context parallelism without processes (``hybridtrain/parallel/context_parallel.py``): the head-tail layout, and the
cp mask against transformers' own full-row masks (``create_causal_mask`` / ``create_sliding_window_causal_mask``),
row by row, for every cp rank, packed rows with documents that cross chunk boundaries included. The attention itself
at cp > 1 is checked against one process in ``tests/dist/test_cp_attention.py``."""
from __future__ import annotations

import copy

import pytest
import torch

from hybridtrain.parallel.context import CPContext
from hybridtrain.parallel.context_parallel import (CPAttention, chunk_indices, context_parallel_attention,
                                                   cp_attention_mask, gather_sequence, register_attention)

S = 16


POSITIONS = {
    "unpacked": torch.arange(S).expand(2, S),
    # documents of 5, 7, 4 and 3, 9, 4 tokens: boundaries inside the chunks of cp = 2 (4 tokens) and cp = 4 (2 tokens)
    "packed": torch.tensor([list(range(5)) + list(range(7)) + list(range(4)),
                            list(range(3)) + list(range(9)) + list(range(4))]),
    # row 0 starts inside a document (positions 3..), row 1 is one document: the batch is still "packed"
    "packed_tail": torch.tensor([list(range(3, 9)) + list(range(10)), list(range(S))]),
}


def test_chunk_indices_are_head_tail():
    assert chunk_indices(8, 1, 0).tolist() == list(range(8))
    assert [chunk_indices(16, 2, r).tolist() for r in range(2)] == [[0, 1, 2, 3, 12, 13, 14, 15],
                                                                   [4, 5, 6, 7, 8, 9, 10, 11]]
    assert [chunk_indices(16, 4, r).tolist() for r in range(4)] == [[0, 1, 14, 15], [2, 3, 12, 13],
                                                                   [4, 5, 10, 11], [6, 7, 8, 9]]
    for cp in (1, 2, 4):  # the ranks' chunks cover the row once
        assert sorted(torch.cat([chunk_indices(S, cp, r) for r in range(cp)]).tolist()) == list(range(S))
    assert chunk_indices(16, 2, 0).dtype == torch.int64
    assert CPContext(rank=1, size=4).indices(16).tolist() == [2, 3, 12, 13]


def test_a_ranks_indices_are_made_once_per_length_and_device(monkeypatch):
    """gpu-review-3 finding 6: every stage, block and loss of every micro-batch asks for the rank's token indices on
    its device; ``CPContext.indices`` makes them once per (length, device) and hands back the same tensor, so on a
    GPU the host-to-device copy happens at the first micro-batch of a shape only. No caller copies them itself."""
    import re
    from pathlib import Path

    import hybridtrain.parallel.context as context

    made = []
    real = context.chunk_indices
    monkeypatch.setattr(context, "chunk_indices", lambda *a: made.append(a) or real(*a))
    cp = CPContext(rank=1, size=2)
    first = cp.indices(16, torch.device("cpu"))
    assert cp.indices(16, "cpu") is first and first.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp.indices(16) is not first and cp.indices(16) is cp.indices(16)  # the host's own, also kept
    assert cp.indices(8, "cpu").tolist() == [2, 3, 4, 5] and cp.indices(16, "meta").device.type == "meta"
    assert made == [(16, 2, 1), (16, 2, 1), (8, 2, 1), (16, 2, 1)]
    root = Path(context.__file__).resolve().parents[1]
    copied = [f"{p.relative_to(root)}:{n}" for p in root.rglob("*.py")
              for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\.indices\([^)]*\)\.to\(", line)]
    assert not copied, copied


@pytest.mark.parametrize("seq_len, cp, rank", [(12, 4, 0), (6, 2, 1), (16, 2, 2), (16, 0, 0)])
def test_chunk_indices_errors(seq_len, cp, rank):
    with pytest.raises(ValueError, match="cp"):
        chunk_indices(seq_len, cp, rank)


def _hf_mask(kind: str, impl: str, positions: torch.Tensor) -> torch.Tensor:
    """transformers' own ``[B, 1, S, S]`` mask of the full rows, as booleans (True = attend)."""
    from transformers import LlamaConfig, MistralConfig
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    common = dict(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, attn_implementation=impl)
    if kind == "causal":
        config, build = LlamaConfig(**common), create_causal_mask
    else:
        config, build = MistralConfig(sliding_window=3, **common), create_sliding_window_causal_mask
    embeds = torch.zeros(positions.shape[0], S, 8, dtype=torch.float64)
    mask = build(config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=positions,
                 allow_is_causal_skip=False)
    return mask if mask.dtype == torch.bool else mask == 0


@pytest.mark.parametrize("rows", list(POSITIONS))
@pytest.mark.parametrize("kind", ["causal", "sliding"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_cp_mask_is_transformers_rows(impl, kind, rows):
    positions = POSITIONS[rows]
    want = _hf_mask(kind, impl, positions)  # [B, 1, S, S]
    window = 3 if kind == "sliding" else None
    for cp in (1, 2, 4):
        for rank in range(cp):
            idx = chunk_indices(S, cp, rank)
            got = cp_attention_mask(positions, idx, window, torch.float64, additive=impl == "eager")
            assert got.shape == (2, 1, S // cp, S)
            got = got if impl == "sdpa" else got == 0
            assert torch.equal(got, want[:, :, idx]), f"cp={cp} rank {rank}"


def test_additive_mask_uses_the_dtype_minimum():
    mask = cp_attention_mask(torch.arange(4).expand(1, 4), torch.arange(4), None, torch.float64, additive=True)
    assert mask.dtype == torch.float64 and mask[0, 0, 0, 1] == torch.finfo(torch.float64).min and mask[0, 0, 1, 0] == 0


def _llama_attention():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                         max_position_embeddings=S, attn_implementation="sdpa")
    torch.manual_seed(0)
    return config, LlamaAttention(config, 0).double(), LlamaRotaryEmbedding(config).double()


def test_cp1_attention_equals_the_module_and_registers_once():
    """At cp = 1 (no group) the registered function is transformers' sdpa under transformers' own packed mask."""
    from transformers.masking_utils import create_causal_mask

    config, attn, rotary = _llama_attention()
    positions = POSITIONS["packed"]
    x = torch.randn(2, S, 16, dtype=torch.float64)
    rope = rotary(x, position_ids=positions)
    mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions)
    want, _ = attn(x, position_embeddings=rope, attention_mask=mask)
    assert register_attention() == register_attention() == "hybridtrain_cp"
    cp_attn = copy.deepcopy(attn)
    cp_attn.config = copy.deepcopy(config)
    cp_attn.config._attn_implementation = register_attention()
    got, _ = cp_attn(x, position_embeddings=rope, attention_mask=None,
                     cp_context=CPAttention(CPContext(), "sdpa", positions))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert gather_sequence(x, CPContext(), dim=1) is x


def test_attention_errors_name_the_fix():
    _, attn, _ = _llama_attention()
    q = k = v = torch.zeros(1, 2, 4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="cp_context=CPAttention"):
        context_parallel_attention(attn, q, k, v, None)
    with pytest.raises(ValueError, match="attention_mask=None"):
        context_parallel_attention(attn, q, k, v, torch.ones(1, 1, 4, 4), cp_context=CPAttention(CPContext()))
    with pytest.raises(ValueError, match=r"use one of \('sdpa', 'eager', 'flash_attention_2'\)"):
        context_parallel_attention(attn, q, k, v, None, cp_context=CPAttention(CPContext(), "hybridtrain_cp"))
    with pytest.raises(ValueError, match="position_ids cover 8"):
        context_parallel_attention(attn, q, k, v, None,
                                   cp_context=CPAttention(CPContext(), "sdpa", torch.arange(8)[None]))


def _varlen_reference(module, q, k, v, mask, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, is_causal,
                      sliding_window=None, scaling=None, **_):
    """FlashAttention 2's variable-length kernel as its documentation defines it (flash-attn >= 2.1), in float64:
    each sequence's queries attend its keys causally aligned at the bottom right (query i sees keys
    j <= i + Sk - Sq) and, with a window, keys j >= i + Sk - Sq - (w - 1). Takes and returns what transformers'
    ``flash_attention_forward`` does (``[1, H, Tq, D]`` in, ``([1, Tq, H, D], None)`` out)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    outs = []
    for n in range(len(cu_seq_lens_q) - 1):
        qs, qe, ks, ke = int(cu_seq_lens_q[n]), int(cu_seq_lens_q[n + 1]), int(cu_seq_lens_k[n]), int(cu_seq_lens_k[n + 1])
        sq, sk = qe - qs, ke - ks
        assert sq <= max_length_q and sk <= max_length_k
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        allowed = j <= i + sk - sq
        if sliding_window is not None:
            allowed &= j >= i + sk - sq - (sliding_window - 1)
        scores = q[0, :, qs:qe] @ k[0, :, ks:ke].transpose(-1, -2) * scaling  # [H, sq, sk]
        outs.append(torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v[0, :, ks:ke])
    return torch.cat(outs, dim=1).transpose(0, 1).unsqueeze(0), None  # [1, Tq, H, D]


@pytest.mark.parametrize("rows", list(POSITIONS))
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("cp", [2, 4])
def test_flash_pieces_give_the_masked_attention(rows, window, cp):
    """The FlashAttention 2 path under cp (``flash_varlen_attention``): one variable-length sequence per piece of a
    document in a rank's chunks, against the dense-mask attention of the same queries and gathered keys, for every
    rank. The kernel is stood in for by its documented semantics on the CPU; tests/gpu runs flash-attn itself."""
    import math

    from torch.nn.functional import scaled_dot_product_attention

    from hybridtrain.parallel.context_parallel import flash_segments, flash_varlen_attention

    positions = POSITIONS[rows]
    torch.manual_seed(1)
    heads, kv_heads, dim = 4, 2, 8
    key = torch.randn(2, kv_heads, S, dim, dtype=torch.float64)
    value = torch.randn(2, kv_heads, S, dim, dtype=torch.float64)
    for rank in range(cp):
        idx = chunk_indices(S, cp, rank)
        query = torch.randn(2, heads, len(idx), dim, dtype=torch.float64)
        got, _ = flash_varlen_attention(_varlen_reference, None, query, key, value, positions, idx,
                                        sliding_window=window, scaling=1 / math.sqrt(dim))
        mask = cp_attention_mask(positions, idx, window, torch.float64, additive=False)  # [B, 1, Sq, S]
        want = scaled_dot_product_attention(query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1),
                                            attn_mask=mask).transpose(1, 2)  # [B, Sq, H, D]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        seg = flash_segments(positions, idx)
        assert int(seg.cu_q[-1]) == 2 * len(idx) and int(seg.cu_k[-1]) == len(seg.key_index)


def test_whole_model_hands_cp_context_to_every_layer():
    """The keyword reaches the attention through transformers' own forward (model -> layers -> attention) and the
    model's mask builders step aside (they return None for an implementation they do not know): at cp = 1 a whole
    packed Mistral equals its sdpa twin. Without a KV cache, as in training (masking_utils detects packing only then)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                           intermediate_size=32, vocab_size=20, max_position_embeddings=S, sliding_window=5,
                           attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).double()
    ids = torch.randint(0, 20, (2, S))
    positions = POSITIONS["packed"]
    want = model(input_ids=ids, position_ids=positions).logits
    model.config._attn_implementation = register_attention()
    got = model(input_ids=ids, position_ids=positions, cp_context=CPAttention(CPContext(), "sdpa", positions)).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_flash_base_reaches_transformers_kernel_lookup_under_its_own_name(monkeypatch):
    """gpu-review-3 finding 1: at cp > 1 the config's attention name is ``hybridtrain_cp`` (as ``ModelBuilder.for_run``
    sets it), and transformers' ``flash_attention_forward`` picks its kernel by ``module.config._attn_implementation``:
    given the module itself it asked for a kernel named ``hybridtrain_cp`` and raised at the first call. The core
    varlen call is stood in for by the kernel's documented semantics (no flash-attn on a CPU); the name it is asked
    for, and the whole packed model's logits against its sdpa twin, are checked."""
    import transformers.integrations.flash_attention as fa
    from transformers import LlamaConfig, LlamaForCausalLM

    asked = []

    def varlen(query, key, value, attention_mask, query_length, is_causal, softmax_scale=None,
               attn_implementation=None, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None,
               max_length_k=None, **_):
        asked.append(attn_implementation)
        out, _ = _varlen_reference(None, *(x.transpose(1, 2) for x in (query, key, value)), None, cu_seq_lens_q,
                                   cu_seq_lens_k, max_length_q, max_length_k, is_causal, scaling=softmax_scale)
        return out

    monkeypatch.setattr(fa, "_flash_attention_forward", varlen)
    config = LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                         intermediate_size=32, vocab_size=20, max_position_embeddings=S, attn_implementation="sdpa",
                         use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double()
    ids = torch.randint(0, 20, (2, S))
    positions = POSITIONS["packed"]
    want = model(input_ids=ids, position_ids=positions).logits
    model.config._attn_implementation = register_attention()
    got = model(input_ids=ids, position_ids=positions,
                cp_context=CPAttention(CPContext(), "flash_attention_2", positions)).logits
    assert asked == ["flash_attention_2"] * 2  # one call per layer, each for the kernel the run asked for
    assert model.config._attn_implementation == "hybridtrain_cp"  # the shared config is left as it was
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
