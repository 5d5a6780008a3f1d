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


def test_a_foreign_pickle_with_rewritten_digests_is_refused_and_runs_nothing(saved_runs, tmp_path):
    """n47: ds/mp_rank_00_model_states.pt replaced by a pickle that writes a file when unpickled, and meta.json's
    size and sha256 of it rewritten (a sender controls meta.json): the digests pass, but the controller's scan of
    the pickle finds a global DeepSpeed never saves; exit 2 before any rank starts, and the marker never appears.
    (The ranks' own scan and the weights-only load itself: tests/unit/test_checkpoint_files.py and
    test_deepspeed_resumes_weights_only_at_every_zero_stage_and_in_a_pipeline.)"""
    import torch

    from hybridtrain.checkpoint.io import DIGESTS, file_digests, file_sizes

    run_dir, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(saved_runs[("gpt_tiny", (1, 1, 1))], run_dir)
    ckpt = RunDir(run_dir).checkpoints / "step_6"
    victim = ckpt / "ds" / "mp_rank_00_model_states.pt"
    torch.save(_Bait(marker), victim)
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "files": file_sizes(ckpt), DIGESTS: file_digests(ckpt)}))
    proc = run_cli(run_dir, "+recipe=gpt_tiny", "trainer.max_steps=8", f"trainer.resume={ckpt}", check=False,
                   timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"config error: trainer.resume: {victim} holds a pickled object outside what DeepSpeed saves (GLOBAL "
            "io.open); it was not written by hybridtrain") in proc.stderr
    assert "Traceback" not in proc.stderr and "launching" not in proc.stdout
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
    (["parallel.zero_stage=3"], "parallel", "resume with parallel.pp=1 parallel.dp=1 parallel.cp=1 parallel.tp=1"),
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


def test_resume_follows_the_resuming_runs_schedule_on_both_paths(saved_runs, tmp_path):
    """Fault probe n48: the final step_6 of a 6-step run resumed with trainer.max_steps=8 and another optim.lr,
    under the same plan (DeepSpeed's ds/, which holds the old schedule's state and the optimizer groups' last lr)
    and at tp=2 (re-sharded through hf/ and optim/): both log, from step 7 on, the lr of the resuming run's
    schedule, and the same losses. The same-plan resume trained step 7 at the old schedule's last lr."""
    from hybridtrain.engine import lr_lambda

    step_6 = RunDir(saved_runs[("gpt_tiny", (1, 1, 1))]).checkpoints / "step_6"
    runs = {}
    for tp in (1, 2):
        runs[tp] = tmp_path / f"tp{tp}"
        run_cli(runs[tp], "+recipe=gpt_tiny", f"parallel.tp={tp}", "trainer.max_steps=8", "optim.lr=2e-3",
                f"trainer.resume={step_6}")
    cfg = compose("+recipe=gpt_tiny", "trainer.max_steps=8", "optim.lr=2e-3")
    expected = [2e-3 * lr_lambda(cfg.optim, 8)(s) for s in (6, 7)]  # optimizer steps 6 and 7 (0-based)
    same, resharded = metrics(runs[1]), metrics(runs[2])
    assert [m["step"] for m in same] == [m["step"] for m in resharded] == [7, 8]
    assert [m["lr"] for m in same] == pytest.approx(expected, rel=1e-9)
    assert [m["lr"] for m in resharded] == pytest.approx(expected, rel=1e-9)
    assert [m["loss"] for m in same] == pytest.approx([m["loss"] for m in resharded], rel=1e-5, abs=0)


# The save's host memory, measured in a spawned gloo world of dp = 2 x tp = 2 (one stage): each rank
# holds its TP shard of a few 16 MiB weights and their AdamW moments (ZeRO-0: the torch optimizer's state),
# and calls the real save_checkpoint with a stand-in engine (DeepSpeed's own part is one small file).
SAVE_FULL = (2048, 2048)  # one full fp32 tensor: 16 MiB
SAVE_SPLITS = {"w.col": dict(dim=0), "w.row": dict(dim=1), "w.qkv": dict(dim=0, fused=4),
               "w.conv1d": dict(dim=1, transpose=True), "w.vocab": dict(dim=0, vocab=2000), "ln.weight": {}}
SAVE_ENV = "HYBRIDTRAIN_TEST_SAVE_DIR"


def _full(name: str):
    import torch

    g = torch.Generator().manual_seed(sum(map(ord, name)))
    hf_name = name.split(".", 1)[1] if name.startswith("exp_avg") else name
    return torch.randn(SAVE_FULL if hf_name.startswith("w.") else SAVE_FULL[:1], generator=g)


def _save_probe(rank: int, world: int, emit) -> None:
    import os
    import resource
    from pathlib import Path
    from types import SimpleNamespace

    import torch
    from transformers import GPT2Config

    import hybridtrain.checkpoint.save as save  # everything the save imports, before the measurement
    from hybridtrain.data.embedded import TOKENIZER
    from hybridtrain.parallel.context import TPContext
    from hybridtrain.parallel.dims import ParallelDims
    from hybridtrain.parallel.groups import sequential_groups
    from hybridtrain.parallel.slicing import Split, local_part

    groups = sequential_groups(ParallelDims(dp=2, tp=2), TPContext())
    tp = groups.tp

    class Stage(torch.nn.Module):
        def __init__(self, named):
            super().__init__()
            self.named = named
            self.weights = torch.nn.ParameterList([p for _, p, _ in named])

        def hf_params(self, include_replicas=False):
            return self.named

    def shard(name, split):
        return local_part(_full(name), split, tp.rank, tp.size)

    def built_for(named):
        state = {p: {k: shard(f"{k}.{n}", s) for k in ("exp_avg", "exp_avg_sq")} for n, p, s in named}

        def ds_save(path, tag, client_state, save_latest):
            (Path(path) / tag).mkdir(exist_ok=True)
            torch.save({"module": torch.zeros(1)}, Path(path) / tag / f"rank{rank}.pt")  # what DeepSpeed's scan accepts

        engine = SimpleNamespace(device=torch.device("cpu"), module=Stage(named), save_checkpoint=ds_save,
                                 optimizer=SimpleNamespace(state=state))
        return SimpleNamespace(engine=engine, tp=tp, ep=groups.ep, tp_rank=groups.coords.tp, dp_rank=groups.coords.dp,
                               data_rank=groups.coords.dp * groups.dims.cp + groups.coords.cp, stage=0,
                               lora=None, model_state_bytes={"optim": 0, "params": 0})

    run_dir = Path(os.environ[SAVE_ENV])
    cfg = SimpleNamespace(trainer=SimpleNamespace(keep_last=None), finetune=SimpleNamespace(objective="sft"))
    plan = SimpleNamespace(zero_stage=0, global_batch_size=1, layout=lambda: {"dp": 2, "tp": 2})
    hf_config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=50257)
    small = [("ln.tiny", torch.nn.Parameter(shard("ln.tiny", Split(dim=0))), Split(dim=0))]  # warm-up: the save's own first-use costs
    save.save_checkpoint(built_for(small), cfg, plan, hf_config, 1, run_dir, TOKENIZER)
    named = [(n, torch.nn.Parameter(shard(n, Split(**kw))), Split(**kw)) for n, kw in SAVE_SPLITS.items()]
    built = built_for(named)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    save.save_checkpoint(built, cfg, plan, hf_config, 2, run_dir, TOKENIZER)
    emit("rise", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
    emit("coords", (groups.coords.dp, groups.coords.tp))


def test_a_save_gathers_each_tensor_to_the_writer_only(tmp_path, monkeypatch):
    """Only data-parallel rank 0's TP rank 0 writes a stage's weights and moments; the others never hold
    them on the host (each rank's peak resident memory during the save, ``ru_maxrss``). Before, every rank
    gathered the whole stage (here 240 MiB of weights and moments) into dicts; the writer
    now streams them into the files one at a time, and the files read back exactly."""
    from safetensors.torch import load_file

    from hybridtrain.checkpoint.io import CheckpointDir, problem
    from hybridtrain.checkpoint.hf_state import to_hf
    from hybridtrain.parallel.slicing import Split
    from hybridtrain.parallel.spawn import run_world

    run = RunDir(tmp_path)
    run.config_file.parent.mkdir(parents=True, exist_ok=True)
    run.config_file.write_text("{}\n")
    run.plan_file.write_text("{}\n")
    monkeypatch.setenv(SAVE_ENV, str(tmp_path))
    # glibc raises its mmap threshold to the largest block freed so far (up to 32 MiB), after which freed
    # 16 MiB blocks stay in its heaps: the resident peak would count the allocator's cache, not the live
    # tensors. A fixed threshold maps and unmaps every block over 1 MiB, so ru_maxrss follows what is alive.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(2**20))
    result = run_world(_save_probe, 4, timeout_s=300)
    assert not result.problems, result.problem_report()
    MiB, full = 2**20, 4 * SAVE_FULL[0] * SAVE_FULL[1]
    rises = {r["coords"]: r["rise"] for r in result.emitted}
    # the stage: 5 full weights and their 2 moments, 240 MiB, which every rank held before
    assert all(rise < full // 2 for c, rise in rises.items() if c != (0, 0)), {c: r / MiB for c, r in rises.items()}
    assert rises[(0, 0)] < 4 * full, {c: r / MiB for c, r in rises.items()}  # one tensor at a time (gloo: 3 copies)
    ckpt = CheckpointDir(run.checkpoints / "step_2")
    assert problem(ckpt.path) is None  # sizes and sha256 digests in meta.json, as before
    weights, moments = load_file(str(ckpt.hf_part(0))), load_file(str(ckpt.optim_part(0)))
    for name, kw in SAVE_SPLITS.items():
        assert torch_equal(weights[name], to_hf(_full(name), Split(**kw)))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch_equal(moments[f"{key}.{name}"], to_hf(_full(f"{key}.{name}"), Split(**kw)))


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


# DeepSpeed's ds/ files read weights-only (hybridtrain/checkpoint/safe_load.py): a real engine per ZeRO stage and
# a one-stage PipelineModule (its layer_NN files) in a spawned 1-rank gloo world, a tiny model each (~15 s in all).
SAFE_LAYOUTS = ["zero0", "zero1", "zero2", "zero3", "pipe"]
SAFE_ENV = "HYBRIDTRAIN_TEST_SAFE_DIR"


def _tiny_engine(layout: str, seed: int):
    import deepspeed
    import torch

    torch.manual_seed(seed)
    layers = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)]
    if layout == "pipe":
        from deepspeed.pipe import PipelineModule

        model = PipelineModule(layers=layers, num_stages=1, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    else:
        model = torch.nn.Sequential(*layers)
    conf = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": 0 if layout == "pipe" else int(layout[-1])},
            "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=conf)
    return engine


def _tiny_step(engine, layout: str) -> None:
    import torch

    x, y = torch.ones(1, 8), torch.zeros(1, 4)
    if layout == "pipe":
        engine.train_batch(iter([(x, y)]))
    else:
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()


def _safe_load_probe(rank: int, world: int, emit) -> None:
    import os
    from pathlib import Path

    import torch

    from hybridtrain.checkpoint.safe_load import ForeignPickleError, foreign_global, loading_safely

    root = Path(os.environ[SAFE_ENV])
    for layout in SAFE_LAYOUTS:
        saved, resumed = _tiny_engine(layout, seed=0), _tiny_engine(layout, seed=1)
        _tiny_step(saved, layout)
        saved.save_checkpoint(str(root / layout), tag="ds")
        files = sorted((root / layout / "ds").iterdir())
        with loading_safely(resumed):
            resumed.load_checkpoint(str(root / layout), tag="ds")
        _tiny_step(saved, layout)  # the next step needs the optimizer state too
        _tiny_step(resumed, layout)
        same = all(torch.equal(a, b) for a, b in zip(saved.module.parameters(), resumed.module.parameters()))
        emit(layout, {"same": same, "files": [f.name for f in files], "foreign": [foreign_global(f) for f in files]})
        # the scans bypassed (a file swapped after them): DeepSpeed's own load refuses the bait, which never runs
        victim = files[-1]
        torch.save(_Bait(root / f"pwned_{layout}"), victim)
        try:
            with loading_safely(resumed):
                resumed.load_checkpoint(str(root / layout), tag="ds")
            emit(f"{layout}_bait", "loaded")
        except ForeignPickleError as err:
            emit(f"{layout}_bait", str(err))


def test_deepspeed_resumes_weights_only_at_every_zero_stage_and_in_a_pipeline(tmp_path, monkeypatch):
    """DeepSpeed's own load_checkpoint, its checkpoint engine swapped for the weights-only one, restores a real
    engine of each ZeRO stage 0-3 and a pipeline (layer_NN files) exactly: after one more step the weights equal
    those of the engine that saved. Each ds/ file's pickle names nothing outside the allowlist; a crafted one put
    in place of a file after the scans is refused by the load itself, naming the file, and never runs."""
    from hybridtrain.checkpoint.safe_load import foreign_message
    from hybridtrain.parallel.spawn import run_world

    monkeypatch.setenv(SAFE_ENV, str(tmp_path))
    result = run_world(_safe_load_probe, 1, timeout_s=300)
    assert not result.problems, result.problem_report()
    got = result.emitted[0]
    assert got["zero3"]["files"] == ["zero_pp_rank_0_mp_rank_00_model_states.pt",
                                     "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert "layer_00-model_states.pt" in got["pipe"]["files"]
    for layout in SAFE_LAYOUTS:
        assert got[layout]["same"], (layout, got[layout])
        assert got[layout]["foreign"] == [None] * len(got[layout]["files"]), (layout, got[layout])
        victim = tmp_path / layout / "ds" / got[layout]["files"][-1]
        assert got[f"{layout}_bait"] == foreign_message(victim, "GLOBAL io.open"), layout  # pickle's name of open()
        assert not (tmp_path / f"pwned_{layout}").exists()
