"""Speed and precision settings that differ on a GPU, checked where a CPU can show them: the DeepSpeed
config (fused AdamW, fp32 gradient accumulation in bf16), the device prefetcher's pass-through
on the CPU and the metrics writer's valid JSON for infinite values."""
from __future__ import annotations

import json

import pytest

from helpers.config import compose
from hybridtrain.engine import ds_config
from hybridtrain.plan import resolve
from hybridtrain.plan.types import Machine


def _conf(precision: str, *overrides: str) -> dict:
    cfg = compose("+recipe=gpt_tiny", f"trainer.precision={precision}", "parallel.dp=1", *overrides)
    plan, _ = resolve(cfg, Machine(gpus_per_node=0, fp16_supported=True, cpu_cores=2))
    return ds_config(cfg, plan)


def test_fused_adamw_follows_optim_fused():
    assert _conf("fp32")["optimizer"]["params"]["fused"] is True  # the default, on CUDA and CPU
    assert _conf("fp32", "optim.fused=false")["optimizer"]["params"]["fused"] is False


def test_deepspeed_hands_fused_to_torch_adamw():
    """DeepSpeed's torch_adam path (engine.py get_optimizer_configuration) pops its own keys and passes
    the rest to torch.optim.AdamW, so ``fused`` reaches torch."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    params = dict(_conf("fp32")["optimizer"]["params"])
    cls, kwargs = DeepSpeedEngine.get_optimizer_configuration(None, params, True)
    opt = cls([torch.nn.Parameter(torch.zeros(2))], **params, **kwargs)
    assert cls is torch.optim.AdamW and opt.defaults["fused"] is True


@pytest.mark.parametrize("precision,accum", [("bf16", "fp32"), ("fp32", None), ("fp16", "fp32")])
def test_gradients_accumulate_and_reduce_in_fp32(precision, accum):
    """16-bit runs accumulate gradients in fp32 and DeepSpeed reduces them in fp32 (its default would cast them
    to the model's dtype before the all-reduce)."""
    conf = _conf(precision)
    assert conf.get("data_types", {}).get("grad_accum_dtype") == accum
    assert conf["communication_data_type"] == "fp32"


@pytest.mark.parametrize("precision, tf32, uses", [("fp32", True, True), ("fp32", False, False),
                                                   ("bf16", True, False), ("fp16", True, False)])
def test_tf32_only_for_fp32_runs(precision, tf32, uses):
    from hybridtrain.gpus import rate_key, uses_tf32

    assert uses_tf32(precision, tf32) is uses
    assert rate_key(precision, tf32) == ("tf32" if uses else "fp32" if precision == "fp32" else "bf16")


def test_device_batches_pass_through_on_cpu():
    import torch

    from hybridtrain.train.prefetch import DeviceBatches

    items = [(torch.ones(2), (torch.zeros(2), torch.tensor(0.5))) for _ in range(3)]
    assert [x for x in DeviceBatches(items, "cpu")] == items  # the very objects: CPU runs are unchanged
    assert list(DeviceBatches(iter([]), torch.device("cpu"))) == []


def test_non_finite_metrics_are_valid_json(tmp_path):
    from hybridtrain.train.loop import MetricsWriter

    writer = MetricsWriter(tmp_path / "m.jsonl")
    writer.write({"step": 1, "loss": 2.5, "grad_norm": float("inf")})
    writer.write({"step": 2, "loss": float("nan"), "grad_norm": 1.0})
    writer.close()
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    first, second = (json.loads(ln, parse_constant=lambda c: pytest.fail(f"{c} in {ln}")) for ln in lines)
    assert first == {"step": 1, "loss": 2.5, "grad_norm": None, "nonfinite": ["grad_norm"]}
    assert second == {"step": 2, "loss": None, "grad_norm": 1.0, "nonfinite": ["loss"]}


# --- issue 29.9: host syncs per micro-batch ------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_embedding_scale_is_hf_s_without_a_device_tensor(dtype):
    """Gemma's embedding scale: the same numbers as transformers' ``GemmaTextScaledWordEmbedding`` in the
    weight's dtype, applied as a Python number (no tensor made on the device each forward)."""
    import torch
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding

    from hybridtrain.parallel.context import TPContext
    from hybridtrain.parallel.layers import VocabParallelEmbedding

    dt = getattr(torch, dtype)
    hidden = 3072  # sqrt is not representable in bf16 / fp16: the rounding must be HF's
    hf = GemmaTextScaledWordEmbedding(50, hidden, 0, embed_scale=hidden ** 0.5)
    hf.embed_scale.fill_(hidden ** 0.5)  # the buffer's value, as HF's _init_weights sets it
    hf = hf.to(dt)
    ours = VocabParallelEmbedding(hf.weight.detach().clone(), 0, 50, TPContext(), padding_idx=0, scale=hidden ** 0.5)
    ids = torch.randint(0, 50, (2, 7))
    made = []
    original = torch.tensor
    torch.tensor = lambda *a, **k: (made.append(k.get("device")), original(*a, **k))[1]
    try:
        got = ours(ids)
    finally:
        torch.tensor = original
    assert torch.equal(got, hf(ids))
    assert all(d is None for d in made)  # only host numbers, never a tensor on the weight's device


def test_unpacked_rows_skip_the_restart_test(monkeypatch):
    """Without ``data.packing=documents`` the blocks give transformers' mask builder no position ids, so it
    never runs ``find_packed_sequence_indices`` (whose test for restarts is a host read: a GPU sync per
    micro-batch), and the mask is the same causal mask."""
    import torch
    import transformers.masking_utils as masking
    from transformers import LlamaConfig

    from hybridtrain.models.stages import BlockInputs

    cfg = LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, vocab_size=32)
    cfg._attn_implementation = "eager"  # an explicit mask, to compare
    hidden, pos = torch.randn(2, 6, 16), torch.arange(6).expand(2, 6)
    calls = []
    find = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda p: (calls.append(1), find(p))[1])
    unpacked, _, _ = BlockInputs(cfg, packed=False)._make(hidden, pos, False, None)
    assert calls == []
    packed, _, _ = BlockInputs(cfg, packed=True)._make(hidden, pos, False, None)
    assert calls == [1]  # the packed path does test the position ids
    assert torch.equal(unpacked["attention_mask"], packed["attention_mask"])


def test_unpacked_model_refuses_packed_rows_on_cpu():
    """A model built for one sequence per row never takes packed rows with a plain causal mask (checked
    where it costs nothing: on a CPU)."""
    import torch
    from transformers import LlamaConfig

    from hybridtrain.models.stages import BlockInputs

    cfg = LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, vocab_size=32)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with pytest.raises(RuntimeError, match="position ids restart inside a row"):
        BlockInputs(cfg, packed=False)._make(torch.randn(1, 6, 16), pos, False, None)


@pytest.mark.parametrize("overrides, packed", [
    (("data.packing=documents",), True), (("data.packing=stream",), False), (("data.packing=none",), False),
    (("data.format=chat",), True)])
def test_a_run_s_blocks_know_whether_rows_are_packed(overrides, packed):
    """The builder of a run takes its packing from the config: only ``documents`` (the default of chat data)
    puts several records in a row."""
    from hybridtrain.models.build import ModelBuilder
    from hybridtrain.parallel.context import TPContext
    from hybridtrain.plan.hf import model_config

    cfg = compose("+recipe=gpt_tiny", *overrides)
    assert ModelBuilder.for_run(cfg, model_config(cfg), TPContext(), 512).packed is packed


def test_device_probes_run_in_a_child_process():
    """The GPU calibration probe runs in a spawned process (the controller never holds a CUDA context); the
    same code path runs here on the CPU and measures."""
    from hybridtrain.plan.calibrate import device_probes

    flops, overhead = device_probes(1, "cpu", (16, 16), in_child=True)
    assert flops > 1e6 and 0 < overhead < 1


@pytest.mark.parametrize("environ,want", [
    ({}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}),
], ids=["unset", "users_old_name", "users_new_name"])
def test_a_gpu_rank_gets_expandable_segments_unless_the_user_set_the_allocator(environ, want):
    """gpu-review-3 finding 11: dropless MoE dispatch (and packed rows) allocate other shapes at every micro-batch;
    a GPU rank's allocator gets expandable segments (``worker._setup_gpu`` before CUDA starts), and a user's own
    allocator settings, under either of torch's names, are kept as they are."""
    from hybridtrain.gpus import allocator_settings

    env = dict(environ)
    allocator_settings(env)
    assert env == want
