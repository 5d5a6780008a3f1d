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
