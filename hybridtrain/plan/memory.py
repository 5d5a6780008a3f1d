"""Memory per rank: parameters, gradients, optimizer state (as DeepSpeed allocates them) and activations.

Model state follows what DeepSpeed 0.19 really allocates (measured by
:func:`hybridtrain.engine.memory.model_state_bytes` and checked in ``tests/dist/test_planning_runs.py``),
with ``P`` the parameters of the rank (after TP and pipeline split), ``d`` = dp, ``w`` = bytes of
a parameter (4 fp32, 2 bf16/fp16), AdamW moments and master weights in fp32:

======= ============================== ================================== =====================================
ZeRO    parameters                     gradients (peak)                   optimizer state
======= ============================== ================================== =====================================
0 fp32  ``4P``                         ``4P``                             ``8P`` (moments)
1 bf16  ``2P``                         ``6P`` (bf16 + fp32 buffer)        ``12P/d`` (BF16 optimizer)
1       ``wP``                         ``max(wP, (w+4)P/d)``              ``12P/d`` (fp32 master + moments)
2       ``wP``                         ``bucket + 4P/d``                  ``12P/d``
3       ``w min(P, P/d + small + 1e9)`` ``bucket + 4P/d``                 ``16P/d``
======= ============================== ================================== =====================================

``bucket`` is DeepSpeed's gradient reduction bucket, ``w x 5e8`` bytes (2 GB in fp32) allocated
whole by ZeRO-2/3 at the first backward; ``small`` are ZeRO-3's persistent parameters (under 1e5
elements), and up to 1e9 gathered parameters stay live.

ZeRO-1 gradients peak either after the backward (every parameter's full gradient, ``wP``) or
inside the step (this rank's averaged partition and its fp32 copy, ``(w+4)P/d``). In bf16 the
gradients accumulate in fp32 (:func:`hybridtrain.engine.ds_config`), which DeepSpeed runs through
its BF16 optimizer: every parameter's bf16 gradient plus a full fp32 gradient buffer, reduced over
dp in fp32 (``communication_data_type``). Where DeepSpeed's engine all-reduces the gradients itself
(ZeRO-0 and the BF16 optimizer at dp x cp > 1) it flattens them into a transient fp32 copy of up to
5e8 elements, counted apart (:func:`reduction_buffer`, ``RankMemory.reduce``); with one replica the
reduction is skipped (``hybridtrain.engine.reduces_gradients``). ZeRO-0 in 16 bits is refused by the plan (``hybridtrain/plan/validate.py``).

Activations (per micro-batch, per rank; measured, not assumed: ``bench/activations.py`` counts every tensor autograd
saves for the backward through hybridtrain's own layers, per storage, parameters excluded, and
``bench/results/activations_2026-12-07_141659.json`` holds the rows and the fit). ``s`` seq len, ``b`` micro-batch,
``h`` hidden, ``I`` MLP width, ``q`` / ``k`` query and key widths (heads x head dim), ``a`` heads, ``t`` = tp,
``w`` activation bytes, ``V`` padded vocabulary; per block, bytes per token (bf16 / fp32, :data:`ACTIVATIONS`):

=========== =================================== =================================== ======== ==========
family      bf16: ``h``, ``I``, ``q``, ``k``    fp32: ``h``, ``I``, ``q``, ``k``    eager/el outside h
=========== =================================== =================================== ======== ==========
llama       16.2, 8.1, 4.5, 4.3                 24.2, 16.1, 9.0, 8.3                6.0 / 4  8 / 12
mistral     as llama                            as llama                            6.0 / 4  8 / 12
qwen2       as llama                            as llama                            6.0 / 4  8 / 12
qwen3       16.4, 8.2, 10.4, 10.5 (q/k norms)   24.4, 16.2, 16.9, 16.5              6.0 / 4  8 / 12
gemma       20.2, 8.1, 4.5, 4.1                 24.2, 16.1, 9.0, 8.1                6.0 / 4  10 / 12
gemma2      36.1, 8.0, 4.5, 4.1 (eager only)    40.1, 16.0, 9.0, 8.1                8.0 / 8  10 / 12
phi3        16.2, 8.1, 8.5, 6.3                 24.2, 16.1, 17.0, 12.3              5.8 / 3.7 8 / 12
olmo2       20.2, 8.1, 13.0, 12.3 (q/k norms)   24.2, 16.1, 17.0, 16.3              6.0 / 4  10 / 12
gpt2        16.9 (q = k = h), 9.9               33.1, 19.9                          2.0 / 4  4 / 8
gpt_neox    20.4 (q = k = h), 4.1               40.5, 8.1                           5.9 / 3.9 3.9 / 7.8
smollm3     as llama (NoPE blocks too)          as llama                            6.0 / 4  8 / 12
olmo3       as olmo2                            as olmo2                            6.0 / 4  10 / 12
gemma3_text 36.5, 8.2, 12.4, 12.6 (q/k norms)   40.5, 16.2, 16.9, 16.6              6.0 / 4  10 / 12
=========== =================================== =================================== ======== ==========

so a Llama-2-7B block keeps about ``47 s b h`` bytes in bf16 (the old assumed ``34 s b h`` was low; the head's
``8 s b V`` was twice the one fp32 ``[s, V]`` the loss keeps: ``4 s b V / t``, Gemma 2 6-8 with its soft-cap).
``eager/el``: eager's bytes per element of the attention matrix ``a s^2 b / t``. The rest follows from the shapes
(:func:`attention_extra`): eager, and sdpa given a mask (packed records, ``data.packing=documents``), keep the keys
and values repeated to every head over the whole row, ``2 w q s b``, in place of sdpa's own ``2 w k s b``, and sdpa
keeps its mask in the activation dtype, ``w`` per element of ``[b, 1, s/cp, s]`` (one per block; at cp > 1 one per
stage). FlashAttention 2 takes the records' boundaries as offsets and keeps no mask (not measured here: GPU only).
With context parallelism the token-wise terms are at ``s / cp`` tokens, and plain causal sdpa keeps the gathered
keys and values of the whole row, ``2 w k s b`` on top of its own (measured), with no mask
(``hybridtrain/parallel/causal_chunks.py``); with tensor parallelism the ``I``, ``q``, ``k`` terms and eager's matrix divide by ``t``, the ``h`` term (norms, residuals) does not (the tp split is the
model's, not measured). With activation checkpointing a block keeps only its input ``s b h w`` and one block is
recomputed at a time. Outside the blocks: ``outside x s b h`` (embedding output, final norm, head input) and
``4 s b V / t``. In 1F1B stage ``s`` holds up to ``min(pp - s, m)`` micro-batches. The MoE families keep
the constants of the dense family with their attention (Qwen3-MoE: Qwen3's, Mixtral: Mistral's, OLMoE: OLMo 2's,
Qwen2-MoE and gpt-oss: Qwen2's; DeepSeek-V3 those of its own dense blocks, MLA's low-rank widths at ``latent`` per
unit) and add, per MoE block, ``routed`` bytes per hidden unit and ``expert`` per unit of one expert's
width ``/ t`` for each of a token's ``top_k`` routed pairs, ``router`` per expert, ``moe_hidden`` per hidden unit and a
shared expert's width at ``mlp`` (``bench.activations.fit_moe``; fp32 8.6, 16, 4; bf16 4.5, 8, 4; gpt-oss's clamped,
interleaved experts 28 per unit of width and a router keeping only its top-k, its eager softmax in the model's
dtype: 2 bytes per matrix element in bf16). On CPUs DeepSeek-V3's sdpa is torch's math kernel, counted as eager
(:func:`kernel_flags`). At ``ep`` = 1 a
rank's experts run exactly its own tokens' pairs; at ``ep`` > 1 they run the pairs the router sends them from every
rank, which the dropless dispatch does not cap: the plan counts :data:`EXPERT_LOAD_MARGIN` times the balanced share
(measured at ep = 2, ``bench.activations.measure_ep``: each pair a rank receives beyond its share costs about three
quarters of the pair's bytes; the margin is put on all of them). Families without measurements
(``model.family=auto``) get Llama's constants (:data:`FALLBACK`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from hybridtrain.config.choices import Packing
from hybridtrain.models.families import family_of
from hybridtrain.models.units import Kind
from hybridtrain.parallel.dims import ParallelDims
from hybridtrain.plan.costs import ModelFacts, UnitFacts, has_score_head, layer_time_costs, model_facts
from hybridtrain.plan.devices import GiB, memory_budget, uses_gpus  # noqa: F401 (GiB: the unit the report prints)

PERSISTENCE_THRESHOLD = 100_000
"""ZeRO-3 keeps parameters smaller than this whole on every rank (DeepSpeed's
``stage3_param_persistence_threshold`` default)."""
REDUCE_BUCKET_SIZE = 500_000_000
"""Elements of the gradient reduction bucket ZeRO-2/3 allocate at the first backward (DeepSpeed's
``reduce_bucket_size`` default; hybridtrain does not set it)."""
ALLREDUCE_BUFFER_SIZE = 500_000_000
"""Elements of the buffer DeepSpeed's engine flattens gradients into for a plain data-parallel all-reduce
(``buffered_allreduce_fallback``'s ``elements_per_buffer``, ``MEMORY_OPT_ALLREDUCE_SIZE``): the reduction of
ZeRO-0 and of the BF16 optimizer (bf16 ZeRO-1) copies up to this many gradient elements at a time."""
MAX_LIVE_PARAMETERS = 1_000_000_000
"""ZeRO-3 keeps gathered parameters until this many are live (``stage3_max_live_parameters``)."""


@dataclass(frozen=True)
class RankMemory:
    """Estimated bytes one rank holds."""

    params: int
    grads: int
    optim: int
    activations: int
    reduce: int = 0
    """The gradient reduction's transient buffer (:func:`reduction_buffer`), alive during the reduction only."""

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optim

    @property
    def total(self) -> int:
        return self.model_state + self.activations + self.reduce


def model_state(sizes: list[int], zero: int, dp: int, precision: str,
                frozen: list[int] | None = None, bucket: bool = True) -> tuple[int, int, int]:
    """(params, grads, optim) bytes for trained parameters of element counts ``sizes`` on one rank, and
    ``frozen`` ones (a LoRA run's base: stored in the run's precision, no gradient, no optimizer state;
    ZeRO-2/3's gradient bucket is then only as large as the trained parameters, see
    :func:`hybridtrain.engine.bucket_size`). ``bucket=False``: without ZeRO-2/3's gradient bucket, which a rank
    allocates once for all its parameters (the experts' state, added to the rest's)."""
    n = sum(sizes)
    f = sum(frozen or [])
    w = 4 if precision == "fp32" else 2
    part = -(-n // dp)  # ZeRO pads the flat buffer to a multiple of dp
    if zero == 0:  # fp32 only: the plan refuses ZeRO-0 in 16 bits
        return 4 * (n + f), 4 * n, 8 * n
    if zero == 1:
        if precision == "bf16":  # BF16 optimizer: bf16 gradients and the fp32 accumulation buffer
            return 2 * (n + f), 6 * n, 12 * part
        return w * (n + f), max(w * n, (w + 4) * part), 12 * part
    bucket = w * (REDUCE_BUCKET_SIZE if frozen is None else min(REDUCE_BUCKET_SIZE, max(1, n))) if bucket else 0
    if zero == 2:
        return w * (n + f), bucket + 4 * part, 12 * part
    every = list(sizes) + list(frozen or [])  # ZeRO-3 partitions frozen parameters too
    persistent = sum(s for s in every if s < PERSISTENCE_THRESHOLD)
    total = n + f
    live = min(total, -(-total // dp) + persistent + MAX_LIVE_PARAMETERS)  # gathered parameters stay until the limit
    return w * live, bucket + 4 * part, 16 * part


def reduction_buffer(trained: int, zero: int, data: int, precision: str) -> int:
    """Bytes of the flat copy DeepSpeed's engine makes of a rank's gradients to all-reduce them over ``data``
    (dp x cp) replicas, where hybridtrain lets it reduce (``hybridtrain.engine.reduces_gradients``): ZeRO-0
    and the BF16 optimizer (bf16 ZeRO-1), whose gradients are fp32, flattened up to
    :data:`ALLREDUCE_BUFFER_SIZE` elements at a time and reduced in fp32 (``communication_data_type``). ZeRO-1
    in fp32 and ZeRO-2/3 reduce through their own buckets, counted in :func:`model_state`."""
    if data == 1 or not (zero == 0 or (zero == 1 and precision == "bf16")):
        return 0
    return 4 * min(ALLREDUCE_BUFFER_SIZE, trained)


def stage_param_sizes(units: list[UnitFacts], tp: int) -> list[int]:
    """Element counts of the parameter tensors one TP rank of a stage holds (a tied head on the
    embedding's stage is the same tensor)."""
    has_embed = any(u.kind is Kind.EMBED for u in units)
    out: list[int] = []
    for u in units:
        if not (u.tied and has_embed):
            out += u.param_sizes(tp)
    return out


def kernel_flags(attn: str, packed: bool, facts: ModelFacts, gpus: bool, precision: str = "bf16") -> dict[str, bool]:
    """What the attention kernel ``attn`` keeps for the backward: ``eager`` (the attention matrix) and ``mask``
    (sdpa with packed records keeps their block-causal mask). ``gpus``: whether the ranks run on GPUs
    (:attr:`~hybridtrain.plan.types.Plan.gpus`). sdpa runs torch's math kernel, which keeps the attention matrix
    like eager:

    - on CPUs where a value head is narrower than a query head (DeepSeek-V3's MLA: torch's CPU flash kernel takes
      equal widths only, ``check_head_dim_size_cpp`` in ``sdp_utils_cpp``; on GPUs the memory-efficient kernel
      takes them and keeps no matrix); measured, ``bench/activations.py``;
    - on GPUs in fp32 with grouped-query attention and no mask (unpacked rows): transformers then passes
      ``enable_gqa=True`` (``use_gqa_in_sdpa``), flash refuses fp32 and the memory-efficient kernel refuses GQA
      (``check_batch_size_and_num_heads_dense`` in ``sdp_utils.cpp``), so torch falls back to math (GPU review 3,
      finding 9). With a mask (packed rows) transformers repeats K and V and the memory-efficient kernel runs."""
    narrow_v = bool(facts.v_dim) and facts.v_dim != facts.kv_dim
    gqa = bool(facts.kv_dim) and bool(facts.q_dim) and facts.kv_dim < facts.q_dim and not narrow_v
    math = attn == "sdpa" and ((not gpus and narrow_v) or (gpus and precision == "fp32" and gqa and not packed))
    return {"eager": attn == "eager" or math, "mask": packed and attn == "sdpa" and not math}


def attention_flags(cfg, facts: ModelFacts, gpus: bool) -> dict[str, bool]:
    """:func:`kernel_flags` of the config's attention kernel and packing."""
    packed = Packing.of(cfg.data.packing, cfg.data.format) is Packing.documents
    return kernel_flags(str(cfg.model.attn_implementation), packed, facts, gpus, str(cfg.trainer.precision))


def memory_flags(cfg, facts: ModelFacts, gpus: bool) -> dict:
    """The keywords of :func:`rank_memory` that come from the config: :func:`attention_flags` and ``loss_chunk``
    (``trainer.loss_chunk_tokens``: the head's logits one piece at a time beyond it)."""
    return {**attention_flags(cfg, facts, gpus), "loss_chunk": int(cfg.trainer.loss_chunk_tokens)}


@dataclass(frozen=True)
class Activations:
    """What a family's decoder block and the layers around it keep for the backward, in bytes, measured by
    ``bench/activations.py`` (the constants of :data:`ACTIVATIONS`): per token of the micro-batch and per unit of a
    width for the token-wise terms, per element for eager's attention matrix.

    Token-wise, a block keeps ``hidden h + mlp I + query q + kv k`` bytes per token (``q`` = heads x head dimension,
    ``k`` = KV heads x head dimension; GPT-2 and GPT-NeoX, whose ``q = k = h``, have them folded into ``hidden``);
    eager adds ``scores`` per element of ``[b, a, s, s]``; outside the blocks the model keeps ``outside h + vocab V / t``
    per token (the embedding's output, the final norm, the head's input, the logits and the loss's fp32
    log-softmax). The rest follows from the attention's shapes (:func:`attention_extra`)."""

    hidden: float
    mlp: float
    query: float = 0.0
    kv: float = 0.0
    scores: float = 0.0
    outside: float = 0.0
    vocab: float = 4.0
    routed: float = 0.0
    """MoE blocks: bytes per routed (token, slot) pair per hidden unit (the rows sorted by expert, their outputs)."""
    expert: float = 0.0
    """MoE blocks: bytes per routed pair per unit of one expert's width (``/ tp``: the experts' MLP activations)."""
    router: float = 0.0
    """MoE blocks: bytes per token per routed expert (the router's probabilities)."""
    moe_hidden: float = 0.0
    """MoE blocks: bytes per token per hidden unit beyond the attention's (the MLP's norm and input, a shared
    expert's gate); an MoE block's shared expert counts ``mlp`` per unit of its width."""
    latent: float = 0.0
    """Multi-head latent attention: bytes per token per unit of its low-rank widths
    (:attr:`~hybridtrain.plan.costs.ModelFacts.latent_dim`: the down-projections' outputs and their norms, kept
    whole on every tensor-parallel rank)."""


ACTIVATIONS: dict[tuple[str, str], Activations] = {
    ("gemma", "bf16"): Activations(hidden=20.196, mlp=8.082, query=4.516, kv=4.132, scores=5.984, outside=10.016, vocab=3.979),  # fit 0.3%
    ("gemma", "fp32"): Activations(hidden=24.196, mlp=16.082, query=9.016, kv=8.132, scores=3.984, outside=12.016, vocab=3.947),  # fit 0.2%
    ("gemma2", "bf16"): Activations(hidden=36.137, mlp=8.037, query=4.507, kv=4.059, scores=7.999, outside=10.016, vocab=6.01),  # fit 0.1%
    ("gemma2", "fp32"): Activations(hidden=40.137, mlp=16.037, query=9.007, kv=8.059, scores=7.999, outside=12.016, vocab=8.01),  # fit 0.1%
    ("gpt2", "bf16"): Activations(hidden=16.875, mlp=9.875, scores=1.984, outside=4.0, vocab=4.014),  # fit 0.4%
    ("gpt2", "fp32"): Activations(hidden=33.05, mlp=19.85, scores=3.984, outside=8.0, vocab=4.016),  # fit 0.3%
    ("gemma3_text", "bf16"): Activations(hidden=36.457, mlp=8.197, query=12.418, kv=12.566, scores=5.984, outside=10.016, vocab=3.979),  # fit 0.4%
    ("gemma3_text", "fp32"): Activations(hidden=40.457, mlp=16.197, query=16.918, kv=16.566, scores=3.984, outside=12.016, vocab=3.947),  # fit 0.3%
    ("gpt_neox", "bf16"): Activations(hidden=20.352, mlp=4.114, scores=5.922, outside=3.875, vocab=4.01),  # fit 0.6%
    ("gpt_neox", "fp32"): Activations(hidden=40.523, mlp=8.136, scores=3.859, outside=7.75, vocab=4.012),  # fit 0.4%
    ("llama", "bf16"): Activations(hidden=16.164, mlp=8.082, query=4.533, kv=4.263, scores=5.984, outside=8.0, vocab=3.994),  # fit 0.3%
    ("llama", "fp32"): Activations(hidden=24.164, mlp=16.082, query=9.033, kv=8.263, scores=3.984, outside=12.0, vocab=3.979),  # fit 0.2%
    ("mistral", "bf16"): Activations(hidden=16.164, mlp=8.082, query=4.533, kv=4.263, scores=5.984, outside=8.0, vocab=3.994),  # fit 0.3%
    ("mistral", "fp32"): Activations(hidden=24.164, mlp=16.082, query=9.033, kv=8.263, scores=3.984, outside=12.0, vocab=3.979),  # fit 0.2%
    ("olmo2", "bf16"): Activations(hidden=20.197, mlp=8.099, query=13.039, kv=12.316, scores=5.984, outside=10.0, vocab=3.979),  # fit 0.3%
    ("olmo2", "fp32"): Activations(hidden=24.197, mlp=16.099, query=17.039, kv=16.316, scores=3.984, outside=12.0, vocab=3.979),  # fit 0.2%
    ("olmo3", "bf16"): Activations(hidden=20.197, mlp=8.099, query=13.039, kv=12.316, scores=5.984, outside=10.0, vocab=3.979),  # fit 0.3%
    ("olmo3", "fp32"): Activations(hidden=24.197, mlp=16.099, query=17.039, kv=16.316, scores=3.984, outside=12.0, vocab=3.979),  # fit 0.2%
    ("phi3", "bf16"): Activations(hidden=16.164, mlp=8.082, query=8.533, kv=6.263, scores=5.828, outside=8.0, vocab=3.994),  # fit 0.3%
    ("phi3", "fp32"): Activations(hidden=24.164, mlp=16.082, query=17.033, kv=12.263, scores=3.672, outside=12.0, vocab=3.979),  # fit 0.2%
    ("qwen2", "bf16"): Activations(hidden=16.164, mlp=8.082, query=4.533, kv=4.263, scores=5.984, outside=8.0, vocab=3.994),  # fit 0.3%
    ("qwen2", "fp32"): Activations(hidden=24.164, mlp=16.082, query=9.033, kv=8.263, scores=3.984, outside=12.0, vocab=3.979),  # fit 0.2%
    ("qwen3", "bf16"): Activations(hidden=16.362, mlp=8.181, query=10.411, kv=10.539, scores=5.984, outside=8.0, vocab=3.979),  # fit 0.4%
    ("qwen3", "fp32"): Activations(hidden=24.362, mlp=16.181, query=16.911, kv=16.539, scores=3.984, outside=12.0, vocab=3.947),  # fit 0.3%
    ("smollm3", "bf16"): Activations(hidden=16.164, mlp=8.082, query=4.533, kv=4.263, scores=5.984, outside=8.0, vocab=3.994),  # fit 0.3%
    ("smollm3", "fp32"): Activations(hidden=24.164, mlp=16.082, query=9.033, kv=8.263, scores=3.984, outside=12.0, vocab=3.979),  # fit 0.2%
    # mixture-of-experts families: their attention family's constants, the MoE MLP's fitted over them (fit_moe)
    ("deepseek_v3", "fp32"): Activations(hidden=24.052, mlp=16.026, query=8.008, kv=8.008, scores=4.0, outside=12.0, vocab=3.979, latent=12.052, routed=8.631, expert=15.987, router=4.016, moe_hidden=0.141),  # attention: its dense blocks' (fit 0.04%)
    ("gpt_oss", "bf16"): Activations(hidden=16.164, mlp=8.082, query=4.533, kv=4.263, scores=2.0, outside=8.0, vocab=3.994, routed=4.688, expert=14.0, router=0.016, moe_hidden=4.383),  # attention: qwen2's, its own eager matrix
    ("gpt_oss", "fp32"): Activations(hidden=24.164, mlp=16.082, query=9.033, kv=8.263, scores=4.0, outside=12.0, vocab=3.979, routed=8.75, expert=28.0, router=0.016, moe_hidden=0.133),  # attention: qwen2's, its own eager matrix
    ("mixtral", "bf16"): Activations(hidden=16.164, mlp=8.082, query=4.533, kv=4.263, scores=5.984, outside=8.0, vocab=3.994, routed=4.625, expert=8.0, router=4.016, moe_hidden=0.359),  # attention: mistral's
    ("mixtral", "fp32"): Activations(hidden=24.164, mlp=16.082, query=9.033, kv=8.263, scores=3.984, outside=12.0, vocab=3.979, routed=8.625, expert=16.0, router=4.016, moe_hidden=0.359),  # attention: mistral's
    ("olmoe", "bf16"): Activations(hidden=20.197, mlp=8.099, query=13.039, kv=12.316, scores=5.984, outside=10.0, vocab=3.979, routed=4.531, expert=8.0, router=4.016, moe_hidden=-4.144),  # attention: olmo2's
    ("olmoe", "fp32"): Activations(hidden=24.197, mlp=16.099, query=17.039, kv=16.316, scores=3.984, outside=12.0, vocab=3.979, routed=8.562, expert=16.0, router=4.016, moe_hidden=0.356),  # attention: olmo2's
    ("qwen2_moe", "bf16"): Activations(hidden=16.164, mlp=8.082, query=4.533, kv=4.263, scores=5.984, outside=8.0, vocab=3.994, routed=4.531, expert=8.0, router=4.016, moe_hidden=2.246),  # attention: qwen2's
    ("qwen2_moe", "fp32"): Activations(hidden=24.164, mlp=16.082, query=9.033, kv=8.263, scores=3.984, outside=12.0, vocab=3.979, routed=8.562, expert=16.0, router=4.016, moe_hidden=4.277),  # attention: qwen2's
    ("qwen3_moe", "bf16"): Activations(hidden=16.362, mlp=8.181, query=10.411, kv=10.539, scores=5.984, outside=8.0, vocab=3.979, routed=4.531, expert=8.0, router=4.016, moe_hidden=0.652),  # attention: qwen3's
    ("qwen3_moe", "fp32"): Activations(hidden=24.362, mlp=16.181, query=16.911, kv=16.539, scores=3.984, outside=12.0, vocab=3.947, routed=8.562, expert=16.0, router=4.016, moe_hidden=0.652),  # attention: qwen3's
}
"""Measured :class:`Activations` by ``(model_type, precision)`` (``"fp32"``, ``"bf16"``; fp16 reads bf16), fitted by
``bench.activations.fit`` from ``bench/results/activations_*.json`` (two-block models of :data:`bench.activations.SHAPES`
at several widths; "fit": the largest error of the least-squares fit of the block's token-wise bytes)."""
MOE_FALLBACK = "qwen3_moe"
"""The family whose constants an MoE family without measurements is given (none today: every registered family
is measured, ``tests/unit/test_activation_memory.py``)."""
FALLBACK = "llama"
"""The family whose constants a family without measurements (``model.family=auto``) is given."""
EXPERT_LOAD_MARGIN = 1.25
"""At ``ep`` > 1, the routed (token, slot) pairs a rank's experts run, over the pairs its own tokens send, that the
plan makes room for (the capacity factor GShard and Switch Transformer use; the dispatch itself is dropless, so a
router that sends a rank more uses more memory than planned). ``docs/moe.md#memory``."""


def activations_of(model_type: str, precision: str) -> Activations:
    """The measured constants of a family (:data:`ACTIVATIONS`; :data:`FALLBACK`'s for an unmeasured family)."""
    p = "fp32" if precision == "fp32" else "bf16"
    return ACTIVATIONS.get((model_type, p)) or ACTIVATIONS[(FALLBACK, p)]


def attention_extra(seq: int, local: int, batch: int, q: int, kv: int, w: int, eager: bool, mask: bool,
                    mask_per_block: bool = True) -> float:
    """Bytes one block's attention keeps beyond its token-wise terms that follow from shapes alone, for ``local`` of
    the row's ``seq`` tokens on this rank (``local = seq / cp``), ``q`` / ``kv`` the query and key widths on the rank.

    Plain causal sdpa at cp = 1 keeps its own keys and values (in the token-wise ``kv`` term) and no mask: 0.
    Eager, and sdpa given a mask (packed records; at cp > 1 the mask is by global token index), keep
    the keys and values repeated to every query head over the whole row, ``2 w q s b``, in place of the ``2 w k
    s/cp b`` of the token-wise term; sdpa keeps the mask in the activation dtype, ``w`` per element of
    ``[b, 1, s/cp, s]`` (measured exactly on CPU, ``bench/activations.py``), unless ``mask_per_block`` is False: the
    context-parallel attention makes one mask per micro-batch that every block shares (counted once per stage by
    :func:`activation_bytes`)."""
    if not (eager or mask):
        return 0.0
    repeated = 2 * w * batch * (q * seq - kv * local)
    return repeated + (0.0 if eager or not mask_per_block else w * batch * local * seq)


def activation_bytes(units: list[UnitFacts], facts: ModelFacts, micro_batch: int, tp: int, precision: str,
                     checkpointing: bool, eager: bool, mask: bool = False, cp: int = 1,
                     loss_chunk: int | None = None, ep: int = 1) -> int:
    """Activation bytes of one micro-batch through ``units`` on one rank (kept for the backward), from the family's
    measured :class:`Activations`.

    At ``cp`` > 1 a rank holds ``s / cp`` tokens of each row: the token-wise terms shrink by ``cp``; the attention
    keeps the keys and values of the whole row: plain causal sdpa (no packed records) unrepeated and with no mask
    (``hybridtrain/parallel/causal_chunks.py``), eager and packed sdpa repeated to every head with the attention over
    ``[s / cp, s]`` (eager's matrix, or the mask, :func:`attention_extra`). With tensor parallelism the MLP, query, key and
    value terms and the attention matrix are split over ``tp``, the ``hidden`` terms (norms, residuals) are not. With
    activation checkpointing a block keeps only its input ``s b h w`` and one block is recomputed at a time (its
    whole activations: the peak during the backward). ``loss_chunk`` (``trainer.loss_chunk_tokens``): a rank whose
    micro-batch holds more tokens makes the logits one piece at a time (``VocabParallelLoss``), so the head's
    term counts one piece. At ``ep`` > 1 an MoE block's routed pairs are counted :data:`EXPERT_LOAD_MARGIN` times:
    the dispatch is dropless, so the rank whose experts the router favours runs more pairs than its tokens send."""
    s, b = facts.seq_len, micro_batch
    local = s // cp  # this rank's tokens of a row
    h = facts.hidden
    q, kv = (facts.q_dim or h) // tp, (facts.kv_dim or h) // tp
    mlp = facts.intermediate or 4 * h
    w = 4 if precision == "fp32" else 2
    c = activations_of(facts.family.model_type, precision)
    if facts.top_k and not c.routed:  # an MoE family without its own measurement: Qwen3-MoE's
        c = activations_of(MOE_FALLBACK, precision)
    attention = c.hidden * h + c.query * q + c.kv * kv + c.latent * facts.latent_dim
    dense = local * b * (attention + c.mlp * mlp / tp)
    # an MoE block: top_k routed pairs per token through E / ep of the experts (at ep = 1 exactly the rank's own
    # pairs; at ep > 1 up to the margin over them, the most loaded rank's), the router's [T, E] probabilities
    load = EXPERT_LOAD_MARGIN if ep > 1 else 1.0
    moe = local * b * (attention + c.moe_hidden * h + c.mlp * facts.shared_width / tp + c.router * facts.num_experts
                       + load * facts.top_k * (c.routed * h + c.expert * facts.expert_width / tp))
    extra = c.scores * facts.heads / tp * local * s * b if eager else 0.0
    shared_mask = cp > 1 and mask and not eager  # the cp sdpa mask: one per micro-batch, shared by the stage's blocks
    if cp > 1 and not (eager or mask):  # mask-free causal chunks: the gathered keys and values of the whole row
        extra += 2 * w * b * kv * s  # (heads unrepeated), kept on top of the rank's own (measured)
    else:
        extra += attention_extra(s, local, b, q, kv, w, eager, mask, mask_per_block=not shared_mask)
    per_block = [(moe if u.experts else dense) + extra for u in units if u.kind is Kind.BLOCK]
    blocks = len(per_block)
    if checkpointing and blocks:
        total = blocks * local * b * h * w + max(per_block)  # inputs kept + one block recomputed
    else:
        total = sum(per_block)
    if shared_mask and blocks:  # [b, 1, s/cp, s] in the activation dtype
        total += w * b * local * s
    if any(u.kind is Kind.HEAD for u in units):
        head_tokens = local * b if not loss_chunk or local * b <= loss_chunk else loss_chunk
        total += head_tokens * c.vocab * (facts.head_out or facts.padded_vocab) / tp
    ends = sum(u.kind in (Kind.EMBED, Kind.HEAD) for u in units)  # the outside terms, half at each end of the model
    total += local * b * c.outside * h * ends / 2
    return int(total)


def in_flight(stage: int, pp: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once in 1F1B."""
    return max(1, min(pp - stage, micro_batches))


def rank_memory(facts: ModelFacts, bounds: list[int], stage: int, dims: ParallelDims, *, zero: int,
                precision: str, micro_batch: int, micro_batches: int, checkpointing: bool,
                eager: bool = False, mask: bool = False,
                lora: Callable[[str], list[int]] | None = None, loss_chunk: int | None = None) -> RankMemory:
    """Estimated memory of a rank of pipeline stage ``stage`` of the layout ``dims`` (``eager``, ``mask``:
    :func:`attention_flags`; ``loss_chunk``: ``trainer.loss_chunk_tokens``, :func:`activation_bytes`). ``lora(unit name)``: the element counts of the LoRA matrices a TP rank holds in
    that unit (``finetune.method=lora``: the rest is frozen)."""
    return units_memory(facts, bounds[stage], bounds[stage + 1], stage, dims, zero=zero, precision=precision,
                        micro_batch=micro_batch, micro_batches=micro_batches, checkpointing=checkpointing,
                        eager=eager, mask=mask, lora=lora, loss_chunk=loss_chunk)


def units_memory(facts: ModelFacts, start: int, stop: int, stage: int, dims: ParallelDims, *, zero: int,
                 precision: str, micro_batch: int, micro_batches: int, checkpointing: bool,
                 eager: bool = False, mask: bool = False,
                 lora: Callable[[str], list[int]] | None = None, loss_chunk: int | None = None) -> RankMemory:
    """:func:`rank_memory` of a stage ``stage`` holding the units ``facts.units[start:stop]``."""
    units = facts.units[start:stop]
    if lora is None:
        trained = stage_param_sizes(units, dims.tp)
        params, grads, optim = model_state(trained, zero, dims.data, precision)
        experts = [n for u in units for n in u.expert_sizes(dims.tp, dims.ep)]
        if experts:  # E / ep experts per rank; ZeRO partitions their state over the dp / ep ranks holding them
            more = model_state(experts, zero, dims.data // dims.ep, precision, bucket=False)  # one bucket per rank
            params, grads, optim = params + more[0], grads + more[1], optim + more[2]
    else:
        trained = [n for u in units for n in lora(u.name)]
        frozen = stage_param_sizes(units, dims.tp) + [n for u in units for n in u.expert_sizes(dims.tp, dims.ep)]
        params, grads, optim = model_state(trained, zero, dims.data, precision, frozen=frozen)
    act = activation_bytes(units, facts, micro_batch, dims.tp, precision, checkpointing, eager, mask, dims.cp,
                           loss_chunk, dims.ep)
    return RankMemory(params, grads, optim, act * in_flight(stage, dims.pp, micro_batches),
                      reduction_buffer(sum(trained), zero, dims.data, precision))


def longest_seq_len(facts: ModelFacts, bounds: list[int], dims: ParallelDims, budget: float, *, zero: int,
                    precision: str, micro_batch: int, micro_batches: int, checkpointing: bool, eager: bool = False,
                    mask: bool = False, limit: int = 1 << 24, loss_chunk: int | None = None) -> int:
    """The longest ``data.seq_len`` (a multiple of ``2 x cp``, the context-parallel chunks) at which every rank of the
    layout fits ``budget`` bytes (:func:`rank_memory` of each stage), 0 if none does; searched up to ``limit``.
    Model state does not depend on the sequence, activations grow with it, so the search is a bisection."""
    step = 2 * dims.cp

    def fits(seq: int) -> bool:
        at = dataclasses.replace(facts, seq_len=seq)
        return all(rank_memory(at, bounds, st, dims, zero=zero, precision=precision, micro_batch=micro_batch,
                               micro_batches=micro_batches, checkpointing=checkpointing, eager=eager,
                               mask=mask, loss_chunk=loss_chunk).total <= budget for st in range(dims.pp))

    lo, hi = 0, limit // step  # in chunks of `step` tokens: lo fits (or is 0), hi + 1 does not
    if not fits(step):
        return 0
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid - 1)
    return lo * step


def balanced_inputs(cfg, hf_config, dims: ParallelDims, zero: int, micro_batches: int, padded_vocab: int,
                    machine, facts: ModelFacts | None = None) -> tuple[list[float], Callable[[int, int, int], bool] | None]:
    """Per-layer time costs and the memory constraint for ``parallel.partition=balanced`` (``facts``: the
    model's :func:`~hybridtrain.plan.costs.model_facts` at this tp, when the caller has them already)."""
    par = cfg.parallel
    facts = facts or model_facts(family_of(cfg.model), hf_config, cfg.data.seq_len, dims.tp,
                                 cfg.model.vocab_pad_multiple, score_head=has_score_head(cfg))
    assert facts.padded_vocab == padded_vocab
    costs = layer_time_costs(facts, par.micro_batch_size, dims)
    per_node = max(1, dims.world // max(1, cfg.launcher.nodes))
    limit = memory_budget(cfg.plan, cfg.launcher, machine, per_node)
    if not limit:
        return costs, None

    flags = memory_flags(cfg, facts, uses_gpus(cfg.launcher, machine))
    known: dict[tuple[int, int, int], bool] = {}  # the partition's search asks for the same stages many times

    def fits(stage: int, start: int, stop: int) -> bool:
        if (stage, start, stop) not in known:
            mem = units_memory(facts, start, stop, stage, dims, zero=zero,
                               precision=cfg.trainer.precision, micro_batch=par.micro_batch_size,
                               micro_batches=micro_batches, checkpointing=par.activation_checkpointing,
                               **flags)
            known[stage, start, stop] = mem.total <= limit
        return known[stage, start, stop]

    return costs, fits
