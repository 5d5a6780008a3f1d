"""``model.family=auto`` through the real CLI: a model type without a verified family trains under tensor
and pipeline parallelism exactly like transformers once the self-check (tp = 1 and tp = 2 on a tiny
twin) has passed; a model whose head scales its logits is refused before anything launches, with the
measured difference."""
from __future__ import annotations

import pytest

from helpers.config import compose
from helpers.launch import metrics, run_cli

HELIUM = ["+recipe=llama_tiny", "model.model_type=helium", "model.family=auto", "+model.config.head_dim=8",
          "trainer.max_steps=3"]  # Helium's default head_dim (128) does not fit llama_tiny's 96 / 12 heads


@pytest.mark.slow  # CI keeps the derivation checks (tests/unit/test_family_auto.py) and the refusal below
def test_auto_family_trains_like_transformers(tmp_path):
    from hybridtrain.reference import reference_run

    proc = run_cli(tmp_path, *HELIUM, "parallel.tp=2", "parallel.pp=2")
    assert "model.family=auto: the adapter derived for helium matches transformers on a tiny twin" in proc.stdout
    want = reference_run(compose(*HELIUM))
    got = metrics(tmp_path)
    assert [m["loss"] for m in got] == pytest.approx([r["loss"] for r in want], rel=1e-4)


@pytest.mark.slow  # CI keeps the refusal in process (tests/unit/test_family_auto.py)
def test_auto_family_with_a_scaled_head_is_refused_with_the_difference(tmp_path):
    proc = run_cli(tmp_path, "+recipe=llama_tiny", "model.model_type=cohere", "model.family=auto", "model.config={}",
                   check=False, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "config error: model.family: auto: the adapter derived for 'cohere'" in proc.stderr
    assert "max |logit difference| / max |logit| = tp=1:" in proc.stderr and "launching" not in proc.stdout
