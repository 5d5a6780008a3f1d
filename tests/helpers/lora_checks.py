"""LoRA runs checked against the real peft (``tests/dist/test_lora_peft.py``, ``tests/dist/test_moe_lora.py``).

Per run: every step's loss equals peft's within 1e-4 (relative) and the adapters train; the trained adapters
equal peft's (names, counts, values 1e-3 of their scale); the base weights in the checkpoint are the pretrained
folder's, bit for bit (frozen); the plan's model-state estimate is within 10% of what rank 0 holds; the exported
adapter folder loads with ``PeftModel.from_pretrained(base, out)`` and gives the logits hybridtrain computed
(``trainer.save_logits``) within 1e-5 of the largest logit, and so does ``--merge``.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from helpers.config import compose
from helpers.launch import losses, metrics
from hybridtrain.checkpoint.io import CheckpointDir
from hybridtrain.rundir import RunDir


@lru_cache(maxsize=None)
def peft_reference(overrides: tuple[str, ...]) -> tuple[list[dict], dict]:
    """peft's one-process run of ``overrides`` (:func:`hybridtrain.reference.reference_run` with
    ``peft.get_peft_model``), cached per test process: per-step records and the trained adapters by peft name."""
    from hybridtrain.plan import apply_pretrained_defaults
    from hybridtrain.reference import reference_run

    cfg = compose(*overrides)
    apply_pretrained_defaults(cfg)
    adapters: dict = {}
    records = reference_run(cfg, adapters=adapters)
    return records, adapters


def peft_logits(folder: Path, adapter: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def check_lora_run(run_dir: Path, folder: Path, want: list[dict], peft_adapters: dict, tmp: Path, steps: int,
                   memory: bool = True) -> None:
    """The checks of one LoRA run of ``steps`` steps on the pretrained ``folder`` (module docstring) against peft's
    records ``want`` and trained adapters ``peft_adapters`` (:func:`peft_reference`); ``tmp`` takes the exports.
    The run saves at ``steps - 1`` with its logits (``trainer.save_logits``) and at ``steps``. ``memory=False``
    leaves out the model-state estimate (ZeRO-3: the plan counts the parameters gathered at the peak, the
    measurement after the step sees only the partitions)."""
    from safetensors.torch import load_file

    from hybridtrain.export import export
    from hybridtrain.models.weights import SafetensorsWeights
    from hybridtrain.plan.estimate import estimate_for_run
    from hybridtrain.train.logits import LOGITS_FILE

    got = losses(run_dir)
    assert len(got) == len(want) == steps
    for step, (g, w) in enumerate(zip(got, [r["loss"] for r in want]), 1):
        assert abs(g - w) <= 1e-4 * abs(w), f"step {step}: hybridtrain {g!r}, peft {w!r}"
    assert got[-1] < got[0]  # the adapters train

    final = CheckpointDir(RunDir(run_dir).checkpoints / f"step_{steps}")
    ours = {k: v for f in final.adapter_parts() for k, v in load_file(str(f)).items()}
    assert set(ours) == set(peft_adapters), (sorted(set(ours) - set(peft_adapters))[:6], sorted(set(peft_adapters) - set(ours))[:6])
    assert sum(t.numel() for t in ours.values()) == sum(t.numel() for t in peft_adapters.values())
    for name, theirs in peft_adapters.items():
        scale = theirs.abs().max().item()
        assert (ours[name] - theirs).abs().max().item() <= 1e-3 * scale, name
    # the base as transformers loads it (an MoE folder's per-expert tensors fused by its conversion table, the
    # names hybridtrain's hf/ keeps), else as stored (a save_pretrained name such as GPT-NeoX's embed_out)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).state_dict()
    pretrained = SafetensorsWeights(folder)
    for name, tensor in {k: v for f in final.hf_parts() for k, v in load_file(str(f)).items()}.items():
        base = loaded[name] if name in loaded else pretrained.get(name)
        assert torch.equal(tensor, base), f"{name} changed: the base is not frozen"

    est, measured = estimate_for_run(run_dir), metrics(run_dir)[-1]["model_state_bytes"]
    assert not memory or abs(est.model_state - measured["total"]) <= 0.10 * measured["total"], (est, measured)

    ckpt = RunDir(run_dir).checkpoints / f"step_{steps - 1}"
    saved = load_file(str(ckpt / LOGITS_FILE))
    ours_logits = saved["logits"]
    tol = 1e-5 * max(1.0, ours_logits.abs().max().item())
    adapter = export(ckpt, tmp / "adapter")
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    diff = (peft_logits(folder, adapter, saved["input_ids"]) - ours_logits).abs().max().item()
    assert diff <= tol, f"PeftModel.from_pretrained logits differ by {diff}"
    merged = export(ckpt, tmp / "merged", merge=True)
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
        diff = (plain(input_ids=saved["input_ids"]).logits - ours_logits).abs().max().item()
    assert diff <= tol, f"--merge logits differ by {diff}"
