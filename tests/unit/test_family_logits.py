"""Every family at (1, 1, 1), in this process: hybridtrain's model built from a ``save_pretrained``
folder (the real config path, shard-by-shard reading, the stage modules) gives transformers' own
logits (``AutoModelForCausalLM.from_pretrained``), fp32, 1e-5 relative. And each tiny config really
exercises its family's trap: switching the trap off in transformers changes the logits."""
from __future__ import annotations

import pytest
import torch

from helpers.families import SEQ, TINY, VOCAB, one_process_model_of

FAMILIES = sorted(TINY)


def _ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))  # [B, S]


def hybridtrain_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    """Logits of hybridtrain's one-process model (tp = 1) for the checkpoint in ``folder``."""
    model = one_process_model_of(folder).eval()
    with torch.no_grad():
        return model.logits(ids)


def transformers_logits(folder, ids: torch.Tensor, **config) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **config).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family, family_folders):
    ids = _ids()
    want = transformers_logits(family_folders[family], ids)
    got = hybridtrain_logits(family_folders[family], ids)
    assert got.shape == want.shape == (2, SEQ, VOCAB)
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5 * scale, f"{family}: max |diff| {diff:.3g} of max |logit| {scale:.3g}"


TRAPS = {  # transformers' own model with the family's trap switched off must give other logits
    "mistral": {"sliding_window": None},
    "qwen2": {"layer_types": ["full_attention"] * 4},
    "qwen3": {"layer_types": ["full_attention"] * 4},
    "gemma2": {"final_logit_softcapping": None, "attn_logit_softcapping": None, "sliding_window": 4096},
    "phi3": {"sliding_window": None},
    "gpt_neox": {"use_parallel_residual": False},
    "qwen3_5_text": {"layer_types": ["full_attention"] * 4},  # blocks 0-2 are Gated DeltaNet
    "smollm3": {"no_rope_layers": [1] * 4},  # blocks 1 and 3 are NoPE
    "olmo3": {"layer_types": ["full_attention"] * 4},  # blocks 0-2 slide, with their own rotary base
    "gemma3_text": {"rope_parameters": {t: {"rope_type": "default", "rope_theta": 10000.0}  # one base for all
                                        for t in ("sliding_attention", "full_attention")}},
}


@pytest.mark.parametrize("family", sorted(TRAPS))
def test_tiny_config_exercises_the_trap(family, family_folders):
    ids = _ids()
    base = transformers_logits(family_folders[family], ids)
    off = transformers_logits(family_folders[family], ids, **TRAPS[family])
    assert (base - off).abs().max().item() > 1e-3 * base.abs().max().item(), f"{family}: {TRAPS[family]} changes nothing"
