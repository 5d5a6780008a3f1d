"""Checkpoints: exact resume, atomic saves, HF export that transformers loads and agrees with."""
from __future__ import annotations

import json
import shutil

import pytest

from hybridtrain.rundir import RunDir
from helpers.config import compose
from helpers.launch import losses, metrics, run_cli


def _batch(recipe: str, step: int):
    from hybridtrain.data.prepare import train_samples

    cfg = compose(f"+recipe={recipe}")
    samples = train_samples(cfg.data, cfg.trainer.seed)
    return samples.rows(samples.global_indices(step, cfg.trainer.global_batch_size))


def _hf_loss(folder, input_ids, labels) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    x, y = torch.from_numpy(input_ids), torch.from_numpy(labels)
    with torch.no_grad():
        return float(model(input_ids=x, labels=y, shift_labels=y).loss)


LAYOUTS = [("gpt_tiny", (1, 1, 1)), ("gpt_tiny", (2, 2, 2)), ("llama_tiny", (1, 2, 2))]


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """One uninterrupted 6-step run per layout, saving every 3 steps."""
    runs = {}
    for recipe, (dp, tp, pp) in LAYOUTS:
        run_dir = tmp_path_factory.mktemp(f"{recipe}_{dp}{tp}{pp}")
        run_cli(run_dir, f"+recipe={recipe}", f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                "trainer.max_steps=6", "trainer.save_every=3", "trainer.export_hf=true", "trainer.save_logits=true")
        runs[(recipe, (dp, tp, pp))] = run_dir
    return runs


@pytest.mark.parametrize("recipe,layout", LAYOUTS[:2], ids=["gpt_111", "gpt_222"])
def test_resume_continues_the_uninterrupted_losses(recipe, layout, saved_runs, tmp_path):
    full = saved_runs[(recipe, layout)]
    dp, tp, pp = layout
    run_cli(tmp_path, f"+recipe={recipe}", f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
            "trainer.max_steps=6", f"trainer.resume={RunDir(full).checkpoints / 'step_3'}")
    resumed = metrics(tmp_path)
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert [m["loss"] for m in resumed] == pytest.approx(losses(full)[3:], rel=1e-6, abs=0)


@pytest.mark.parametrize("recipe,layout", LAYOUTS, ids=["gpt_111", "gpt_222", "llama_122"])
def test_export_loads_in_transformers_and_gives_the_same_loss(recipe, layout, saved_runs, tmp_path, capsys):
    from transformers import AutoTokenizer

    from hybridtrain.export import main

    run_dir = saved_runs[(recipe, layout)]
    assert main([str(RunDir(run_dir).checkpoints / "step_3"), str(tmp_path / "hf"), "--check"]) == 0
    assert "check passed: max |transformers - hybridtrain| logit = " in capsys.readouterr().out
    # the model after 3 steps computes step 4's loss
    assert _hf_loss(tmp_path / "hf", *_batch(recipe, 3)) == pytest.approx(losses(run_dir)[3], rel=1e-5)
    # trainer.export_hf=true exported the final model, which has no later step: check its tensors load
    assert _hf_loss(run_dir / "hf", *_batch(recipe, 0)) > 0
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.eos_token == "<|endoftext|>" and tok.decode(tok.encode("In the beginning")) == "In the beginning"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == 8000 and config["tie_word_embeddings"] is True


def test_export_check_without_saved_logits_is_explained(saved_runs, tmp_path, capsys):
    from hybridtrain.export import main

    checkpoint = shutil.copytree(RunDir(saved_runs[("gpt_tiny", (1, 1, 1))]).checkpoints / "step_3", tmp_path / "step_3")
    (checkpoint / "logits.safetensors").unlink()
    assert main([str(checkpoint), str(tmp_path / "hf"), "--check"]) == 2
    assert "logits.safetensors does not exist: --check needs a checkpoint saved with trainer.save_logits=true" \
        in capsys.readouterr().err


def test_sharded_export_writes_an_index(saved_runs, tmp_path):
    from hybridtrain.export import export

    run_dir = saved_runs[("gpt_tiny", (1, 1, 1))]
    export(RunDir(run_dir).checkpoints / "step_3", tmp_path / "hf", max_shard_size="1MB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert _hf_loss(tmp_path / "hf", *_batch("gpt_tiny", 3)) == pytest.approx(losses(run_dir)[3], rel=1e-5)


def test_export_replaces_an_earlier_export_in_the_same_folder(saved_runs, tmp_path):
    from hybridtrain.export import export

    run_dir = saved_runs[("gpt_tiny", (1, 1, 1))]
    export(RunDir(run_dir).checkpoints / "step_6", tmp_path / "hf", max_shard_size="1MB")  # sharded, newer
    export(RunDir(run_dir).checkpoints / "step_3", tmp_path / "hf", overwrite=True)         # single file, older
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert _hf_loss(tmp_path / "hf", *_batch("gpt_tiny", 3)) == pytest.approx(losses(run_dir)[3], rel=1e-5)


def test_interrupted_save_is_never_loaded(saved_runs, tmp_path):
    from hybridtrain.checkpoint.io import latest_checkpoint

    run_dir = tmp_path / "run"
    shutil.copytree(saved_runs[("gpt_tiny", (1, 1, 1))], run_dir)
    ckpts = RunDir(run_dir).checkpoints
    assert latest_checkpoint(run_dir) == ckpts / "step_6"
    (ckpts / "step_6" / "meta.json").unlink()            # killed before the save completed
    (ckpts / ".tmp-step_9").mkdir()                      # an interrupted save in progress
    assert latest_checkpoint(run_dir) == ckpts / "step_3"
    proc = run_cli(run_dir, "+recipe=gpt_tiny", "trainer.max_steps=8", f"trainer.resume={ckpts / 'step_6'}",
                   check=False, timeout=120)
    assert proc.returncode == 2
    assert "not a complete checkpoint" in proc.stderr and "step_3" in proc.stderr


def test_truncated_checkpoint_file_is_named_and_auto_resume_falls_back(saved_runs, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(saved_runs[("gpt_tiny", (1, 1, 1))], run_dir)
    ckpts = RunDir(run_dir).checkpoints
    victim = next((ckpts / "step_6" / "hf").glob("model-stage*.safetensors"))
    victim.write_bytes(victim.read_bytes()[:100])
    proc = run_cli(run_dir, "+recipe=gpt_tiny", "trainer.max_steps=8", f"trainer.resume={ckpts / 'step_6'}",
                   check=False, timeout=120)
    assert proc.returncode == 2
    assert victim.name in proc.stderr and "truncated or corrupt" in proc.stderr and "step_3" in proc.stderr
    proc = run_cli(run_dir, "+recipe=gpt_tiny", "trainer.max_steps=8", "trainer.resume=auto", "launcher.dry_run=true",
                   timeout=120)
    assert "skipping a checkpoint that cannot be loaded" in proc.stdout and victim.name in proc.stdout
    assert f"resume: {ckpts / 'step_3'}" in proc.stdout


class _Bait:
    """Unpickling it calls ``open(marker, "w")``: a crafted pickle that writes a file when loaded
    (``tests/unit/test_checkpoint_files.py`` shows that plain unpickling does write it)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _tamper(ckpt, how: str, marker):
    """Change checkpoint ``ckpt`` as an attacker or a bad disk would; return the file changed."""
    import pickle

    bait = pickle.dumps(_Bait(marker))
    if how == "rng_pickle":    # the RNG file replaced by a pickle
        f = ckpt / "rng" / "rank_00000.safetensors"
    elif how == "ds_pickle":   # DeepSpeed's model states replaced by a crafted pickle
        f = ckpt / "ds" / "mp_rank_00_model_states.pt"
    else:                      # same_size: one byte of the weights flipped, the size unchanged
        f = next((ckpt / "hf").glob("model-stage*.safetensors"))
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
        return f
    size = f.stat().st_size if f.exists() else len(bait)
    f.write_bytes(bait.ljust(size, b"\0"))  # same size as the file it replaces: only the digest tells
    return f


@pytest.mark.parametrize("how", ["rng_pickle", "ds_pickle", "same_size"])
def test_tampered_checkpoint_is_refused_before_anything_loads(how, saved_runs, tmp_path):
    """Resuming from a checkpoint whose files changed since the save (a crafted pickle put in place of
    rng/rank_00000 or of a ds/*.pt file, a byte of the weights flipped; a file added to ds/ is refused
    the same way, tests/unit/test_checkpoint_files.py) ends with
    exit 2 before any rank starts, naming the file and the newest good checkpoint; the crafted pickle
    never runs (its marker file never appears). trainer.resume=auto skips it and falls back."""
    run_dir, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(saved_runs[("gpt_tiny", (1, 1, 1))], run_dir)
    ckpts = RunDir(run_dir).checkpoints
    victim = _tamper(ckpts / "step_6", how, marker)
    proc = run_cli(run_dir, "+recipe=gpt_tiny", "trainer.max_steps=8", f"trainer.resume={ckpts / 'step_6'}",
                   check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"config error: trainer.resume: {victim}" in proc.stderr
    assert "does not match its sha256 digest in meta.json: corrupt or replaced since the save" in proc.stderr
    assert f"the newest loadable checkpoint there is {ckpts / 'step_3'}" in proc.stderr
    assert "Traceback" not in proc.stderr and "launching" not in proc.stdout
    if how == "same_size":
        proc = run_cli(run_dir, "+recipe=gpt_tiny", "trainer.max_steps=8", "trainer.resume=auto",
                       "launcher.dry_run=true", timeout=120)
        assert f"skipping a checkpoint that cannot be loaded: {victim}" in proc.stdout
        assert f"resume: {ckpts / 'step_3'}" in proc.stdout
    assert not marker.exists()


def test_resume_from_a_file_says_what_it_is(saved_runs, tmp_path):
    """trainer.resume= the meta.json of a checkpoint: exit 2 saying it is a file and naming the checkpoint
    folder it lies in (other files: tests/unit/test_checkpoint_files.py)."""
    step_6 = RunDir(saved_runs[("gpt_tiny", (1, 1, 1))]).checkpoints / "step_6"
    target = step_6 / "meta.json"
    proc = run_cli(tmp_path / "run", "+recipe=gpt_tiny", "trainer.max_steps=8", f"trainer.resume={target}",
                   "launcher.dry_run=true", check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"config error: trainer.resume: '{target}' is a file ({target.stat().st_size} bytes), not a checkpoint "
            f"folder; it lies inside the checkpoint {step_6}: give that folder") in proc.stderr
    assert "does not exist" not in proc.stderr


def test_keep_last_prunes_old_checkpoints(tmp_path):
    from hybridtrain.checkpoint.io import finalize

    root = RunDir(tmp_path).checkpoints
    for step in (1, 2, 3):
        tmp = root / f".tmp-step_{step}"
        tmp.mkdir(parents=True)
        finalize(tmp, root / f"step_{step}", keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_3"]
    assert (root / "latest").read_text() == "step_3"


@pytest.mark.parametrize("overrides,key,fragment", [
    (["parallel.zero_stage=3"], "parallel", "resume with parallel.pp=1 parallel.dp=1 parallel.tp=1"),
    (["trainer.max_steps=6"], "trainer.max_steps", "at step 6 already"),
    (["trainer.global_batch_size=24"], "trainer.global_batch_size", "resume with trainer.global_batch_size=12"),
    (["model.config.n_layer=2"], "model.config.n_layer", "resume with the same model"),
], ids=["zero3_plan_change", "nothing_left", "batch_change", "shape_change"])
def test_resume_mismatch_is_a_config_error(overrides, key, fragment, saved_runs, tmp_path):
    ckpt = RunDir(saved_runs[("gpt_tiny", (1, 1, 1))]).checkpoints / "step_6"
    overrides = ["trainer.max_steps=10", *overrides]
    proc = run_cli(tmp_path, "+recipe=gpt_tiny", *overrides, f"trainer.resume={ckpt}", check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"config error: {key}:" in proc.stderr and fragment in proc.stderr


def test_resumed_fine_tune_starts_fresh_from_the_pretrained_folder(saved_runs, tmp_path):
    """A fine-tune's command line with trainer.resume=auto (what a SLURM requeue reruns) is accepted:
    without a checkpoint it starts from model.pretrained; with one, the checkpoint wins."""
    run_dir = saved_runs[("gpt_tiny", (1, 1, 1))]  # exported its final model to run_dir/hf
    proc = run_cli(tmp_path / "run", "+recipe=gpt_tiny", f"model.pretrained={run_dir / 'hf'}", "trainer.resume=auto",
                   "launcher.dry_run=true", timeout=120)
    assert "starting fresh" in proc.stdout


def test_resume_auto_without_checkpoint_starts_fresh(tmp_path):
    proc = run_cli(tmp_path, "+recipe=gpt_tiny", "trainer.resume=auto", "launcher.dry_run=true", timeout=120)
    assert "starting fresh" in proc.stdout


RESHARDS = [(("gpt_tiny", (2, 2, 2)), (1, 1, 1)), (("gpt_tiny", (2, 2, 2)), (1, 2, 1)),
            (("llama_tiny", (1, 2, 2)), (2, 1, 1))]


@pytest.mark.parametrize("source,target", [pytest.param(*r, id=i, marks=[pytest.mark.slow] if i == "gpt_222_to_121" else [])
                                           for r, i in zip(RESHARDS, ["gpt_222_to_111", "gpt_222_to_121", "llama_122_to_211"])])
def test_resume_under_another_plan_continues_the_losses(source, target, saved_runs, tmp_path):
    recipe, _ = source
    dp, tp, pp = target
    proc = run_cli(tmp_path, f"+recipe={recipe}", f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                   "trainer.max_steps=6", f"trainer.resume={RunDir(saved_runs[source]).checkpoints / 'step_3'}")
    assert "re-sharded from" in proc.stdout
    resumed = metrics(tmp_path)
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert [m["loss"] for m in resumed] == pytest.approx(losses(saved_runs[source])[3:], rel=1e-5, abs=0)
    assert [m["lr"] for m in resumed] == pytest.approx([m["lr"] for m in metrics(saved_runs[source])[3:]])
