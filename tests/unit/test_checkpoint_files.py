"""A checkpoint's files: nothing in one runs code, every file is verified against its sha256 digest
before anything is loaded, RNG states round-trip through safetensors, and a full disk is named.

The checkpoints here are folders laid out as :mod:`hybridtrain.checkpoint.io` describes, written
in the test process (no ranks): a DeepSpeed-style ``ds/*.pt`` pickle, a safetensors RNG file, an HF
config, and the ``meta.json`` a save writes. The runs that save and resume for real are in
``tests/dist/test_checkpoint.py`` and ``tests/dist/test_faults.py``.
"""
from __future__ import annotations

import ast
import json
import pickle
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridtrain.checkpoint.io import (DIGESTS, CheckpointDir, CheckpointError, file_digests, file_sizes, problem,
                                      verify_share)
from hybridtrain.checkpoint.save import load_verified, restore_rng, save_rng
from hybridtrain.checkpoint.space import is_disk_full, space_problem

ROOT = Path(__file__).resolve().parents[2]
DS_FILE = "ds/mp_rank_00_model_states.pt"


class _Bait:
    """Unpickling it calls ``open(marker, "w")``: a pickle that writes a file when it is loaded."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _crafted(marker: Path) -> bytes:
    return pickle.dumps(_Bait(marker))


def _seal(path: Path) -> None:
    """Write ``meta.json`` as a save does: sizes and digests of every other file."""
    meta = {"step": 3, "samples_seen": 36, "plan": {}, "files": file_sizes(path), DIGESTS: file_digests(path)}
    CheckpointDir(path).meta_file.write_text(json.dumps(meta))


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    ckpt = CheckpointDir(tmp_path / "run" / "checkpoints" / "step_3")
    for d in (ckpt.ds, ckpt.rng, ckpt.hf):
        d.mkdir(parents=True)
    torch.save({"module": {"w": torch.randn(4, 4)}}, ckpt.path / DS_FILE)  # what DeepSpeed writes: a pickle
    save_rng(ckpt.rng_file(0))
    (ckpt.hf / "config.json").write_text("{}")
    _seal(ckpt.path)
    return ckpt.path


class _Engine:
    """Records whether DeepSpeed's ``load_checkpoint`` was reached, and through which checkpoint engine."""

    device = torch.device("cpu")
    _config = None

    def __init__(self):
        self.loaded, self.checkpoint_engine = [], "DeepSpeed's own"

    def load_universal_checkpoint(self):
        return False

    def load_checkpoint(self, path, tag):
        self.loaded.append((path, tag))
        self.loaded_through = type(self.checkpoint_engine).__name__


def test_the_bait_runs_code_when_unpickled(tmp_path):
    """The crafted file is a real attack: plain unpickling (what DeepSpeed's torch.load(weights_only=False)
    does) writes the marker. The tests below show that hybridtrain never gets there."""
    marker = tmp_path / "pwned"
    pickle.loads(_crafted(marker))
    assert marker.exists()


@pytest.mark.parametrize("target", [DS_FILE, "rng/rank_00000.safetensors"], ids=["ds", "rng"])
def test_crafted_pickle_in_a_checkpoint_is_refused_before_anything_loads(checkpoint, target, tmp_path):
    marker = tmp_path / "pwned"
    f = checkpoint / target
    f.write_bytes(_crafted(marker).ljust(f.stat().st_size, b"\0"))  # same size: only the digest tells
    # the controller, while planning the resume
    assert problem(checkpoint) == f"{f} does not match its sha256 digest in meta.json: corrupt or replaced since the save"
    # the ranks, when started without that check: DeepSpeed's pickles are verified before it opens one,
    # and the RNG file is safetensors, which refuses anything else without running it
    engine = _Engine()
    with pytest.raises(CheckpointError if target == DS_FILE else Exception) as err:
        load_verified(SimpleNamespace(engine=engine), checkpoint, rank=0, world=1)
    if target == DS_FILE:
        assert engine.loaded == [] and "does not match its sha256 digest" in str(err.value)
    assert not marker.exists()


def test_a_file_added_to_ds_is_refused(checkpoint, tmp_path):
    marker = tmp_path / "pwned"
    (checkpoint / "ds" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(_crafted(marker))
    for why in (problem(checkpoint), verify_share(checkpoint, "ds", 0, 1)):
        assert "zero_pp_rank_0_mp_rank_00_optim_states.pt is not listed in meta.json" in why
    engine = _Engine()
    with pytest.raises(CheckpointError, match="is not listed in meta.json"):
        load_verified(SimpleNamespace(engine=engine), checkpoint, rank=0, world=1)
    assert engine.loaded == [] and not marker.exists()


DS_FILES = {"model_states": DS_FILE, "zero_optim_states": "ds/zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero3_model_states": "ds/zero_pp_rank_0_mp_rank_00_model_states.pt",
            "pipeline_layer": "ds/layer_01-model_00-model_states.pt"}
"""The ds/ files DeepSpeed unpickles on a same-plan resume: ZeRO-0 (model states), ZeRO-1/2 (optimizer partitions),
ZeRO-3 (partitioned model states) and pp > 1 (one file per layer)."""


@pytest.mark.parametrize("target", DS_FILES.values(), ids=DS_FILES.keys())
@pytest.mark.parametrize("form", ["torch_save", "raw_pickle"])
def test_a_foreign_pickle_with_rewritten_digests_runs_nothing(checkpoint, target, form, tmp_path):
    """n47: a ds/ file replaced by a pickle that writes a marker file when unpickled, meta.json's size and sha256
    rewritten to match (the sender controls meta.json): the controller's check, the ranks' check and the
    weights-only load each refuse it, naming the file and the global, and the marker never appears."""
    from hybridtrain.checkpoint.safe_load import ForeignPickleError, _engine_class, foreign_message

    marker = tmp_path / "pwned"
    f = checkpoint / target
    if form == "torch_save":
        torch.save(_Bait(marker), f)  # the zip archive DeepSpeed writes, its data.pkl naming open()
        what = "GLOBAL io.open"
    else:
        f.write_bytes(_crafted(marker))
        what = "not a torch.save zip archive, the format DeepSpeed writes"
    _seal(checkpoint)
    want = foreign_message(f, what)
    assert problem(checkpoint) == want  # the controller: exit 2 before any rank starts
    engine = _Engine()
    with pytest.raises(CheckpointError) as err:  # the ranks, started without that check
        load_verified(SimpleNamespace(engine=engine), checkpoint, rank=0, world=1)
    assert str(err.value) == f"refusing to load {checkpoint}: {want}" and engine.loaded == []
    with pytest.raises(ForeignPickleError) as err:  # DeepSpeed's load itself, had the file changed after both checks
        _engine_class()(None).load(str(f), map_location="cpu")
    assert str(err.value).startswith(f"{f} holds a pickled object outside what DeepSpeed saves (")
    assert not marker.exists()


def test_a_file_swapped_after_the_scans_is_refused_by_the_load_itself(checkpoint, tmp_path):
    """The ranks' scans passed, then the file changed (a shared folder): DeepSpeed's load, through the
    weights-only checkpoint engine load_verified sets, refuses it with one line naming it, and it never runs."""
    marker, f = tmp_path / "pwned", checkpoint / DS_FILE

    class Swapping(_Engine):
        def load_checkpoint(self, path, tag):  # what DeepSpeed does: each ds/ file through its checkpoint engine
            torch.save(_Bait(marker), f)
            self.checkpoint_engine.load(str(f), map_location="cpu")

    with pytest.raises(CheckpointError) as err:
        load_verified(SimpleNamespace(engine=Swapping()), checkpoint, rank=0, world=1)
    assert str(err.value).startswith(f"{f} holds a pickled object outside what DeepSpeed saves (GLOBAL io.open)")
    assert not marker.exists()


def test_the_allowlist_is_what_deepspeed_saves():
    """Every name of the allowlist is a DeepSpeed class, none of them a callable that could reach code: the
    loss scalers, the ZeRO stage enum and ZeRO-1/2's fragment address (real files: tests/dist/test_checkpoint.py)."""
    import enum

    from hybridtrain.checkpoint.safe_load import DEEPSPEED_GLOBALS, allowed_globals

    assert all(name.startswith("deepspeed.") for name in DEEPSPEED_GLOBALS)
    for obj in allowed_globals():
        assert isinstance(obj, type), obj
        assert issubclass(obj, enum.Enum) or obj.__module__.startswith("deepspeed."), obj


def test_a_file_corrupted_at_the_same_size_is_named(checkpoint):
    f = checkpoint / DS_FILE
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    assert problem(checkpoint) == f"{f} does not match its sha256 digest in meta.json: corrupt or replaced since the save"


def test_intact_checkpoint_passes_and_loads(checkpoint):
    assert problem(checkpoint) is None
    engine = _Engine()
    load_verified(SimpleNamespace(engine=engine), checkpoint, rank=0, world=1)
    assert engine.loaded == [(str(checkpoint), "ds")]
    # through the weights-only engine, and DeepSpeed's own put back afterwards (its saves are DeepSpeed's)
    assert engine.loaded_through == "WeightsOnlyCheckpointEngine" and engine.checkpoint_engine == "DeepSpeed's own"
    # two ranks split the files: rank 1 of 2 has none of the single ds file, rank 0 all of it
    assert verify_share(checkpoint, "ds", 1, 2) is None and verify_share(checkpoint, "ds", 0, 2) is None


def test_checkpoint_without_digests_is_refused(checkpoint):
    meta = json.loads((checkpoint / "meta.json").read_text())
    del meta[DIGESTS]
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    assert "has no file digests in meta.json" in problem(checkpoint)


def test_rng_states_round_trip_through_safetensors(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.standard_normal()  # numpy caches the second Gaussian of a pair: part of its state
    random.gauss(0, 1)           # so does Python's
    ckpt = CheckpointDir(tmp_path / "step_1")
    ckpt.rng.mkdir(parents=True)
    save_rng(ckpt.rng_file(0))
    want = (torch.rand(3), np.random.standard_normal(3), random.gauss(0, 1), random.random())
    torch.manual_seed(9)
    np.random.seed(9)
    random.seed(9)
    restore_rng(ckpt.path, 0)
    got = (torch.rand(3), np.random.standard_normal(3), random.gauss(0, 1), random.random())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2:] == want[2:]
    from safetensors import safe_open

    with safe_open(str(ckpt.rng_file(0)), framework="pt") as f:  # a safetensors file, no pickle inside
        assert set(f.keys()) == {"torch", "numpy_keys", "python_words"}


def _unsafe_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls that can run code from a file: ``torch.load`` without ``weights_only=True``, ``pickle``'s
    and ``yaml``'s loaders, ``numpy.load(allow_pickle=True)``, ``eval`` and ``exec``."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
        if ((name == "torch.load" and kw.get("weights_only") != "True") or name in ("eval", "exec")
                or name.startswith(("pickle.", "cPickle.", "dill.", "marshal.")) or name in ("yaml.load", "yaml.unsafe_load")
                or (name.endswith("np.load") or name == "numpy.load") and kw.get("allow_pickle") == "True"):
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_nothing_in_the_package_unpickles():
    """Every file hybridtrain reads is safetensors, JSON or YAML; its torch.loads are weights_only=True: a test
    world's emitted tensors, and DeepSpeed's ds/ pickles (hybridtrain/checkpoint/safe_load.py, an allowlist of what
    DeepSpeed saves, in place of DeepSpeed's own torch.load(weights_only=False)), which are also verified against
    their digests and scanned for foreign globals first (above)."""
    hits = [f"{p.relative_to(ROOT)}:{n}: {call}" for p in sorted((ROOT / "hybridtrain").rglob("*.py"))
            for n, call in _unsafe_calls(ast.parse(p.read_text()))]
    assert hits == []
    assert _unsafe_calls(ast.parse("torch.load(f, weights_only=False)\npickle.load(f)\neval(s)"))  # it finds them


def test_free_space_is_checked_against_the_checkpoint_size(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=20_000_000))
    why = space_problem(tmp_path / "checkpoints", 50_000_000)
    assert why.startswith("no space left on ") and "(needs 0.05 GB for the checkpoint, 0.02 GB free)" in why
    assert space_problem(tmp_path / "checkpoints", 10_000_000) is None


@pytest.mark.skipif(not Path("/dev/full").is_char_device(), reason="no /dev/full device on this system")
def test_a_write_into_a_full_disk_is_recognised(tmp_path):
    """/dev/full answers every write with ENOSPC (written through a link, so that a writer that
    replaces its target by a rename never touches the device): torch's zip writer then raises the
    'unexpected pos' RuntimeError of the issue, a plain write an OSError; both are a full disk.
    (safetensors writes a temporary file and renames it, so the real full disk of a save is in
    tests/dist/test_faults.py, on a small tmpfs.)"""
    link = tmp_path / "full"
    link.symlink_to("/dev/full")
    errors = []
    for write in (lambda: torch.save({"w": torch.zeros(1 << 20)}, str(link)),
                  lambda: link.open("wb", buffering=0).write(b"\0" * 4096)):
        with pytest.raises((RuntimeError, OSError)) as err:
            write()
        errors.append(err.value)
    assert "unexpected pos" in str(errors[0])
    assert all(is_disk_full(e) for e in errors), [repr(e) for e in errors]
    assert not is_disk_full(RuntimeError("a shape mismatch")) and not is_disk_full(OSError(2, "No such file"))


def test_auto_resume_refuses_a_directory_whose_checkpoints_all_fail(checkpoint, capsys):
    """trainer.resume=auto with checkpoints none of which loads: a fresh start would overwrite their
    step_N folders and metrics.jsonl, so it is a config error (with none at all it starts fresh)."""
    from hybridtrain.checkpoint.resume import resolve_resume
    from hybridtrain.errors import PlanError

    cfg = SimpleNamespace(trainer=SimpleNamespace(resume="auto"))
    run_dir = checkpoint.parent.parent
    (checkpoint / "hf" / "config.json").write_text("[]")  # same size, another digest
    with pytest.raises(PlanError, match=r"trainer.resume: auto found no loadable checkpoint in .*checkpoints \(1 cannot "
                                        r"be loaded, the newest: .*config.json does not match its sha256 digest"):
        resolve_resume(cfg, None, None, run_dir)
    assert "skipping a checkpoint that cannot be loaded" in capsys.readouterr().out
    shutil.rmtree(checkpoint)
    assert resolve_resume(cfg, None, None, run_dir) is None


@pytest.mark.parametrize("what", ["inside_a_checkpoint", "elsewhere", "missing"])
def test_resume_from_a_path_that_is_no_checkpoint_folder_says_what_it_is(what, checkpoint, tmp_path):
    from hybridtrain.checkpoint.resume import resolve_resume
    from hybridtrain.errors import PlanError

    target = {"inside_a_checkpoint": checkpoint / DS_FILE, "elsewhere": tmp_path / "notes.txt",
              "missing": tmp_path / "step_9"}[what]
    if what == "elsewhere":
        target.write_text("not a checkpoint")
    with pytest.raises(PlanError) as err:
        resolve_resume(SimpleNamespace(trainer=SimpleNamespace(resume=str(target))), None, None, tmp_path)
    expected = "give a RUN_DIR/checkpoints/step_N folder (the one that holds meta.json) or auto"
    want = {"inside_a_checkpoint": f"'{target}' is a file ({target.stat().st_size if target.exists() else 0} bytes), "
                                   f"not a checkpoint folder; it lies inside the checkpoint {checkpoint}: give that folder",
            "elsewhere": f"'{target}' is a file (16 bytes), not a checkpoint folder; {expected}",
            "missing": f"'{target}' does not exist; {expected}"}[what]
    assert str(err.value) == f"trainer.resume: {want}"


def test_a_streamed_file_is_what_save_file_writes(tmp_path):
    """The checkpoint's stage files are written tensor by tensor (never all of a stage in one dict): the
    bytes equal safetensors' own ``save_file`` of the same tensors, whatever order they arrive in."""
    from safetensors.torch import save_file

    from hybridtrain.checkpoint.stream import StreamedSafetensors

    g = torch.Generator().manual_seed(0)
    tensors = {"transformer.h.0.attn.c_attn.weight": torch.randn(6, 4, generator=g).t(),  # not contiguous
               "lm.bias": torch.randn(5, generator=g), "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5),
               "exp_avg.transformer.wte.weight": torch.randn(7, 2, generator=g)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    specs = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    with StreamedSafetensors(tmp_path / "ours.safetensors", specs, {"format": "pt"}) as f:
        for name in reversed(list(tensors)):
            f.write(name, tensors[name])
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_a_streamed_file_refuses_a_wrong_or_missing_tensor(tmp_path):
    from hybridtrain.checkpoint.stream import StreamedSafetensors

    specs = {"a": ((2, 3), torch.float32), "b": ((4,), torch.float32)}
    f = StreamedSafetensors(tmp_path / "x.safetensors", specs)
    with pytest.raises(ValueError, match=r"'a' is \(3, 2\).*declares \(2, 3\)"):
        f.write("a", torch.zeros(3, 2))
    f.write("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="written twice"):
        f.write("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\['b'\] were declared but never written"):
        f.close()


def test_hf_shapes_are_known_before_the_gather():
    """The stage files' headers are written before any tensor is gathered, from each shard's shape."""
    from hybridtrain.checkpoint.hf_state import hf_shape, to_hf, unshard
    from hybridtrain.parallel.slicing import Split, shard_tensor

    cases = [(torch.zeros(12, 5), Split(dim=0, fused=3)), (torch.zeros(8, 6), Split(dim=1, transpose=True)),
             (torch.zeros(10, 4), Split(dim=0, vocab=9)), (torch.zeros(3, 4), Split()), (torch.zeros(6), Split(dim=0))]
    for full, split in cases:
        shards = [shard_tensor(full, split.dim, split.fused, r, 2) if split.dim is not None else full for r in range(2)]
        joined = unshard(shards, split) if split.dim is not None else full
        assert hf_shape(torch.nn.Parameter(shards[0]), split, 2) == tuple(to_hf(joined, split).shape), split
    zero3 = torch.nn.Parameter(torch.zeros(0))
    zero3.ds_shape = torch.Size([4, 6])  # a ZeRO-3 partitioned parameter: its full shape is ds_shape
    assert hf_shape(zero3, Split(dim=1, transpose=True), 2) == (12, 4)


def _resolve(value: str, run_dir: Path, *overrides: str, model_type: str = "gpt2"):
    """:func:`resolve_resume` of ``trainer.resume=value`` for the fixture checkpoint (its plan: every axis 1,
    global batch 12) under the composed ``gpt_tiny`` recipe and ``overrides``."""
    from hybridtrain.checkpoint.resume import resolve_resume
    from hybridtrain.plan.types import saved_layout

    from helpers.config import cfg_of

    cfg = cfg_of("+recipe=gpt_tiny", *overrides)
    cfg.trainer.resume = value
    plan = SimpleNamespace(layout=lambda: saved_layout({}), global_batch_size=12)
    return resolve_resume(cfg, plan, SimpleNamespace(model_type=model_type), run_dir)


@pytest.mark.parametrize("how", ["explicit", "auto"])
def test_a_meta_json_that_is_not_json_is_an_incomplete_checkpoint(how, checkpoint, capsys):
    """Fault probe n44: ``meta.json`` cut in half. An explicit resume is a config error naming it and the newest
    loadable checkpoint (not a JSONDecodeError traceback); ``auto`` skips it for the previous step."""
    from hybridtrain.errors import PlanError

    older = shutil.copytree(checkpoint, checkpoint.with_name("step_2"))
    meta = CheckpointDir(checkpoint).meta_file
    meta.write_text(meta.read_text()[: meta.stat().st_size // 2])
    run_dir = checkpoint.parent.parent
    if how == "explicit":
        with pytest.raises(PlanError) as err:
            _resolve(str(checkpoint), run_dir)
        assert str(err.value).startswith(f"trainer.resume: {checkpoint} is not a complete checkpoint (meta.json is "
                                         "not valid JSON: ")
        assert str(err.value).endswith(f"cut short or edited since the save); the newest loadable checkpoint there "
                                       f"is {older}")
    else:
        assert _resolve("auto", run_dir) == older
        assert (f"skipping a checkpoint that cannot be loaded: {checkpoint} is not a complete checkpoint (meta.json "
                "is not valid JSON") in capsys.readouterr().out


def test_a_meta_json_without_what_a_save_writes_is_an_incomplete_checkpoint(checkpoint, tmp_path, capsys):
    """A ``meta.json`` that is JSON but lacks the step (edited): an explicit resume names what is missing and the
    newest loadable checkpoint, and export says the same in one line, exit 2, no folder (both were a KeyError or
    JSONDecodeError traceback)."""
    import json

    from hybridtrain.errors import PlanError
    from hybridtrain.export import main

    older = shutil.copytree(checkpoint, checkpoint.with_name("step_2"))
    meta = CheckpointDir(checkpoint).meta_file
    record = json.loads(meta.read_text())
    del record["step"]
    meta.write_text(json.dumps(record))
    with pytest.raises(PlanError) as err:
        _resolve(str(checkpoint), checkpoint.parent.parent)
    assert str(err.value) == (f"trainer.resume: {checkpoint} is not a complete checkpoint (meta.json has no step: "
                              f"edited since the save); the newest loadable checkpoint there is {older}")
    meta.write_text("{\"step\": 4, \"pl")  # and cut short
    assert main([str(checkpoint), str(tmp_path / "out")]) == 2
    assert "export error: " in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_checkpoint_of_another_model_type_is_refused(checkpoint):
    """Fault probe n49: a gpt2 checkpoint resumed by a Llama recipe is a config error naming model.model_type,
    before any rank starts (it was a state-dict traceback in the ranks)."""
    from hybridtrain.errors import PlanError

    (checkpoint / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    _seal(checkpoint)
    assert _resolve(str(checkpoint), checkpoint.parent.parent) == checkpoint
    with pytest.raises(PlanError) as err:
        _resolve(str(checkpoint), checkpoint.parent.parent, model_type="llama")
    assert str(err.value) == (f"model.model_type: the checkpoint {checkpoint} is gpt2 but this run's model is llama; "
                              "resume with the same model (the recipe that saved it, model.model_type=gpt2)")


def _shuffled_tokenizer(source: Path, out: Path) -> Path:
    """``source`` (a BPE tokenizer.json) with the ids of its ordinary tokens permuted: the same size and tokens."""
    spec = json.loads(source.read_text())
    special = {t["id"] for t in spec["added_tokens"]}
    vocab = spec["model"]["vocab"]
    ordinary = [t for t, i in vocab.items() if i not in special]
    ids = [vocab[t] for t in ordinary]
    random.Random(0).shuffle(ids)
    vocab.update(zip(ordinary, ids))
    out.write_text(json.dumps(spec))
    return out


def test_a_tokenizer_other_than_the_checkpoints_is_refused(checkpoint, tmp_path):
    """Fault probe n51: the embedded tokenizer with its ids shuffled (the same 8000 tokens) passes every shape
    check; the resume compares it with the checkpoint's hf/tokenizer.json (as a save writes it) and refuses it,
    naming data.tokenizer and the checkpoint's own. The run's own tokenizer passes."""
    from hybridtrain.checkpoint.io import save_tokenizer
    from hybridtrain.data.embedded import TOKENIZER
    from hybridtrain.errors import PlanError

    save_tokenizer(TOKENIZER, checkpoint / "hf")
    _seal(checkpoint)
    run_dir = checkpoint.parent.parent
    assert _resolve(str(checkpoint), run_dir) == checkpoint
    shuffled = _shuffled_tokenizer(TOKENIZER, tmp_path / "shuffled.json")
    with pytest.raises(PlanError) as err:
        _resolve(str(checkpoint), run_dir, f"data.tokenizer={shuffled}")
    message = str(err.value)
    assert message.startswith(f"data.tokenizer: {shuffled} is not the tokenizer the checkpoint {checkpoint} was "
                              "trained with (the token ")
    assert message.endswith(f"; resume with the checkpoint's own, data.tokenizer={checkpoint / 'hf'}, or start a new "
                            "run")
    assert _resolve(str(checkpoint), run_dir, f"data.tokenizer={checkpoint / 'hf'}") == checkpoint


def test_a_latest_pointer_to_no_checkpoint_is_noted(checkpoint, capsys):
    """Fault probe n70: ``checkpoints/latest`` rewritten to point out of the run; ``auto`` (which takes the newest
    loadable step_N) says in one line that it ignored it, and says nothing about a good pointer."""
    run_dir = checkpoint.parent.parent
    pointer = checkpoint.parent / "latest"
    pointer.write_text("step_3")
    assert _resolve("auto", run_dir) == checkpoint
    assert "latest" not in capsys.readouterr().out
    pointer.write_text("../../../../../etc")
    assert _resolve("auto", run_dir) == checkpoint
    assert (f"[hybridtrain] note: {pointer} names '../../../../../etc', which is no step_N folder of this run; "
            "ignored (auto takes the newest loadable step_N)") in capsys.readouterr().out


def test_a_tokenizer_with_the_same_ids_that_splits_text_otherwise_is_told_apart(tmp_path):
    """The same vocabulary and ids with another pre-tokenizer (a prefix space) encodes text to other ids: told apart
    by the probe text; the file as a save rewrites it (save_pretrained) is not."""
    from hybridtrain.checkpoint.io import save_tokenizer
    from hybridtrain.checkpoint.resume import tokenizer_difference
    from hybridtrain.data.embedded import TOKENIZER

    spec = json.loads(TOKENIZER.read_text())
    spec["pre_tokenizer"]["add_prefix_space"] = True
    variant = tmp_path / "prefix.json"
    variant.write_text(json.dumps(spec))
    (tmp_path / "hf").mkdir()
    save_tokenizer(variant, tmp_path / "hf")
    assert tokenizer_difference(tmp_path / "hf" / "tokenizer.json", variant) is None
    assert tokenizer_difference(TOKENIZER, variant).startswith("the same vocabulary splits text differently")
