"""The plan's activation memory (``hybridtrain/plan/memory.py``) against the bytes autograd really keeps.

Measured on CPU by ``bench/activations.py``: every tensor saved for the backward of one micro-batch through
hybridtrain's own layers, counted once per storage, parameters excluded (exact, whatever the machine's load). The
estimate must be within 10% for every family, at long-ish sequences (512-1024 tokens on a 64-wide model, so the
``s^2`` terms weigh), with sdpa and eager, fp32 and bf16, packed records and activation checkpointing. The cp = 2
measurement (two gloo ranks) is in ``tests/dist/test_activation_memory_cp.py``, the ep = 2 one in
``tests/dist/test_activation_memory_ep.py``.
"""
from __future__ import annotations

import pytest

from bench.activations import EAGER_ONLY, FP32_ONLY, SHAPES, estimate, measure, measured_peak

TOLERANCE = 0.10


def base_attn(family: str) -> str:
    return "eager" if family in EAGER_ONLY else "sdpa"  # transformers gives Gemma 2 and gpt-oss no sdpa


CASES = [
    ("bf16 s=1024", dict(seq_len=1024, precision="bf16")),
    ("fp32 eager s=512", dict(seq_len=512, precision="fp32", attn="eager")),
    ("bf16 packed checkpointing s=1024", dict(seq_len=1024, precision="bf16", packed=True, checkpointing=True)),
]
"""Live measurements per family, longer than the fitting rows (s = 256, 512): the s^2 terms weigh here (in fp32
for the families the plan runs in fp32 only, :data:`bench.activations.FP32_ONLY`; DeepSeek-V3's sdpa is torch's
math kernel on CPU, which the estimate counts)."""


LIVE_CI = {"llama", "gemma2"}
"""Measured live in CI: Llama (the constants most families share) and Gemma 2 (eager, soft-caps); the other
families in the slow tier (every family's fitting rows are still checked in CI, from the recorded results)."""


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f in LIVE_CI else [pytest.mark.slow]) for f in SHAPES])
def test_estimate_is_within_10_percent_of_the_measured_activations(family):
    """Per family, the estimate against the measured bytes for each case of :data:`CASES` (all at cp = 1)."""
    off = {}
    for name, case in CASES:
        case = {"attn": base_attn(family), **case, **({"precision": "fp32"} if family in FP32_ONLY else {})}
        row = measure(family, **case)
        est, real = estimate(row), measured_peak(row)
        off[name] = (est, real, est / real - 1)
    bad = {k: v for k, v in off.items() if abs(v[2]) > TOLERANCE}
    assert not bad, f"{family}: (estimate, measured, error) {bad}"


def test_every_recorded_row_is_within_10_percent():
    """Every row of the newest ``bench/results/activations_*.json``: the fitting rows of every family (widths,
    kernels, dtypes, packing, checkpointing) and the cp = 1 and cp = 2 rows (two gloo ranks, per rank)."""
    import json

    from helpers.config import ROOT

    result = json.loads(sorted((ROOT / "bench" / "results").glob("activations_*.json"))[-1].read_text())
    rows = result["rows"] + result["cp1"] + result["cp2"]
    off = [(r["family"], r.get("tag"), r["cp"], round(estimate(r) / measured_peak(r) - 1, 3)) for r in rows]
    assert {r["family"] for r in result["rows"]} == set(SHAPES)
    assert not [o for o in off if abs(o[-1]) > TOLERANCE], off


def test_recorded_ep_2_rows_fit_the_margin_and_need_it():
    """The newest ``bench/results/activations-ep_*.json`` (``bench.activations.EP_CASES`` on two gloo ranks, each
    with its own tokens): every rank's measured bytes are at most the plan's ep = 2 estimate, which is within 10% of
    them; the ranks' experts received unequal shares, and the one that received more than its tokens sent
    exceeds the balanced estimate (the margin off), so the margin is what covers it."""
    import json

    from helpers.config import ROOT

    import hybridtrain.plan.memory as memory

    path = sorted((ROOT / "bench" / "results").glob("activations-ep_*.json"))[-1]
    result = json.loads(path.read_text())
    ep2 = result["ep2"]
    assert len(ep2) == 2 * len(result["ep1"]) and all(r["ep"] == 2 for r in ep2)
    off = [(r["family"], r["precision"], r["checkpointing"], estimate(r) / measured_peak(r) - 1) for r in ep2]
    assert all(0 <= o[-1] <= TOLERANCE for o in off), off
    heavier = [r for r in ep2 if r["received"] > r["sent"]]
    assert heavier and all(r["received"] / r["sent"] <= memory.EXPERT_LOAD_MARGIN for r in ep2)
    balanced = [estimate({**r, "ep": 1}) for r in heavier]  # the same rank's estimate without the margin
    assert all(b < measured_peak(r) for b, r in zip(balanced, heavier)), list(zip(balanced, map(measured_peak, heavier)))
    twins = [(r["family"], estimate(r) / measured_peak(r) - 1) for r in result["ep1"]]
    assert all(abs(t[-1]) <= TOLERANCE for t in twins), twins


def test_the_old_assumed_constant_undercounted_the_attention_and_overcounted_the_head():
    """What the measurement changed: the block's bf16 bytes per ``s b h`` of a Llama shape are the family's (MLP
    and heads counted by their widths), and the head keeps one fp32 ``[s, V]`` tensor, not two."""
    from hybridtrain.plan.memory import activations_of

    llama = activations_of("llama", "bf16")
    h, mlp, q, kv = 4096, 11008, 4096, 4096  # Llama-2-7B
    per_h = (llama.hidden * h + llama.mlp * mlp + llama.query * q + llama.kv * kv) / h
    assert 40 < per_h < 70, per_h
    assert 3.9 < llama.vocab < 4.1


def _longest(budget_gib: int, **kernel) -> dict[int, int]:
    """The plan's longest ``data.seq_len`` at cp = 1 and 2 for Llama-2-7B on 8 ranks (tp = 2, dp x cp = 4, ZeRO-1,
    bf16, activation checkpointing) within ``budget_gib`` per rank."""
    from helpers.config import compose
    from hybridtrain.models.families import family_of
    from hybridtrain.parallel.dims import ParallelDims
    from hybridtrain.plan import model_config
    from hybridtrain.plan.costs import model_facts
    from hybridtrain.plan.memory import GiB, longest_seq_len

    cfg = compose("+recipe=llama_7b", "trainer.precision=bf16")
    hf = model_config(cfg)
    facts = model_facts(family_of(cfg.model), hf, 4096, 2)
    return {cp: longest_seq_len(facts, [0, len(facts.units)], ParallelDims(dp=8 // cp, cp=cp, tp=2, pp=1),
                                budget_gib * GiB, zero=1, precision="bf16", micro_batch=1, micro_batches=1,
                                checkpointing=True, **kernel) for cp in (1, 2)}


def test_longest_packed_sequence_that_fits_is_at_least_1_8x_longer_at_cp_2():
    """Packed records with sdpa (a mask at both cp): the plan's longest sequence on 40 GiB ranks at cp = 2 is at
    least 1.8x that at cp = 1 (17,134 -> 31,952 tokens)."""
    longest = _longest(40, mask=True)
    assert longest[1] > 4096 and longest[2] >= 1.8 * longest[1], longest


def test_longest_plain_causal_sequence_is_at_least_1_8x_longer_at_cp_2():
    """Plain causal sdpa (no mask at either cp: mask-free chunks at cp = 2): 106,436 -> 205,952 tokens on 80 GiB."""
    longest = _longest(80)
    assert longest[2] >= 1.8 * longest[1], longest


def test_every_family_has_measured_constants():
    """Every registered family has fitting shapes in ``bench/activations.py`` and its own measured constants in the
    plan, in every precision the plan lets it run (none falls back on another family's)."""
    from bench.activations import FP32_ONLY
    from hybridtrain.models.families import FAMILIES
    from hybridtrain.plan.memory import ACTIVATIONS

    measured = set(FAMILIES) - UNMEASURED
    assert set(SHAPES) == measured
    missing = [(f, p) for f in measured for p in ("fp32", "bf16") if not (p == "bf16" and f in FP32_ONLY)
               and (f, p) not in ACTIVATIONS]
    assert not missing, missing
    assert all(ACTIVATIONS[f, "fp32"].routed > 0 for f, fam in FAMILIES.items() if fam.moe is not None and f in measured)
    # the open exceptions are exactly those still without constants: measuring one fails here until it is removed
    assert not any((f, "fp32") in ACTIVATIONS for f in UNMEASURED) and UNMEASURED <= set(FAMILIES)


UNMEASURED = {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}
"""The Gated DeltaNet families, merged without measured activation constants (issue 42 point 7 is open: their
recurrent state and conv are not in bench/activations.py yet); the plan counts them with a fallback."""


def test_deepseek_sdpa_keeps_the_attention_matrix_on_cpus_only():
    """DeepSeek-V3's value heads are narrower than its query heads: torch's CPU sdpa runs the math kernel (the
    attention matrix kept, as eager; measured in the M rows), a GPU's memory-efficient kernel keeps none. Heads of
    equal widths take the fused kernels on both."""
    from hybridtrain.plan.memory import kernel_flags
    from bench.activations import _facts

    mla = _facts("deepseek_v3", "{}")
    assert mla.v_dim < mla.kv_dim and mla.latent_dim == 32 + 32 + 8
    assert kernel_flags("sdpa", False, mla, gpus=False) == {"eager": True, "mask": False}
    assert kernel_flags("sdpa", True, mla, gpus=True) == {"eager": False, "mask": True}
    gqa = _facts("llama", "{}")
    assert gqa.v_dim == gqa.kv_dim and gqa.latent_dim == 0
    assert kernel_flags("sdpa", False, gqa, gpus=False) == {"eager": False, "mask": False}
    assert kernel_flags("eager", True, gqa, gpus=True) == {"eager": True, "mask": False}


def test_fp32_grouped_query_sdpa_on_gpus_keeps_the_attention_matrix():
    """GPU review 3, finding 9: unpacked rows of a GQA model in fp32 on GPUs take torch's math kernel (transformers
    passes ``enable_gqa=True`` without a mask; flash refuses fp32, the memory-efficient kernel refuses GQA), which
    keeps the matrix as eager; bf16, packed rows (K and V repeated, memory-efficient) and equal heads keep none."""
    from hybridtrain.plan.memory import kernel_flags
    from bench.activations import _facts

    gqa, mha = _facts("llama", "{}"), _facts("gpt2", "{}")
    assert 0 < gqa.kv_dim < gqa.q_dim
    assert kernel_flags("sdpa", False, gqa, gpus=True, precision="fp32") == {"eager": True, "mask": False}
    assert kernel_flags("sdpa", False, gqa, gpus=True, precision="bf16") == {"eager": False, "mask": False}
    assert kernel_flags("sdpa", True, gqa, gpus=True, precision="fp32") == {"eager": False, "mask": True}
    assert kernel_flags("sdpa", False, gqa, gpus=False, precision="fp32") == {"eager": False, "mask": False}
    assert kernel_flags("sdpa", False, mha, gpus=True, precision="fp32") == {"eager": False, "mask": False}


def test_deepseek_shared_experts_count_at_their_width():
    """DeepSeek-V3's ``n_shared_experts`` run as one MLP that many experts wide: the plan's shared width."""
    from bench.activations import _facts

    assert _facts("deepseek_v3", "{}").shared_width == 32
    assert _facts("deepseek_v3", '{"n_shared_experts": 2}').shared_width == 64
    assert _facts("qwen2_moe", "{}").shared_width == 64 and _facts("qwen3_moe", "{}").shared_width == 0


def test_cpu_sdpa_keeps_the_matrix_exactly_where_value_heads_are_narrower():
    """The torch fact behind :func:`hybridtrain.plan.memory.kernel_flags` on CPUs: sdpa with DeepSeek-V3's head
    widths (queries and keys 24, values 16, its ratio) saves the attention matrix (the math kernel); with equal
    widths the CPU flash kernel saves none. The GPU side: ``tests/gpu/test_gpu_mla_sdpa.py``."""
    from helpers.sdpa_saved import keeps_attention_matrix

    assert keeps_attention_matrix("cpu", 24, 16)
    assert not keeps_attention_matrix("cpu", 24, 24)
