"""Choosing and checking the checkpoint a run resumes from (launcher side, no deepspeed)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from hybridtrain.checkpoint.io import CheckpointDir, latest_checkpoint, latest_pointer_problem, problem
from hybridtrain.config.schema import Config
from hybridtrain.errors import PlanError
from hybridtrain.plan.types import Plan, saved_layout
from hybridtrain.rundir import RunDir


def resolve_resume(cfg: Config, plan: Plan, hf_config, run_dir: Path) -> Optional[Path]:
    """The complete checkpoint ``trainer.resume`` names, checked against this run (every file against
    the sha256 digests of its ``meta.json``, ``ds/`` pickles against what DeepSpeed saves); ``None`` when ``auto`` finds
    no checkpoint at all (a fresh start). ``auto`` refuses a directory whose checkpoints all fail.

    With ``model.pretrained`` as well (a fine-tune that is resumed, e.g. after a SLURM requeue), the
    checkpoint wins: its weights, optimizer state and step; the folder still gives the model's config
    and tokenizer, and a fresh start loads its weights."""
    from hybridtrain.models.families import family_of

    if cfg.trainer.resume == "auto":
        skipped: list[str] = []
        _note_latest_pointer(run_dir)
        path = latest_checkpoint(run_dir, skipped)
        for why in skipped:
            print(f"[hybridtrain] skipping a checkpoint that cannot be loaded: {why}")
        if path is None and skipped:  # a fresh start would overwrite their step_N folders and metrics.jsonl
            raise PlanError("trainer.resume", f"auto found no loadable checkpoint in {RunDir(run_dir).checkpoints} "
                            f"({len(skipped)} cannot be loaded, the newest: {skipped[0]}); resume from one named "
                            "explicitly, move them away to start fresh, or use another hydra.run.dir")
        if path is None:
            return None
    else:
        path = _checkpoint_folder(cfg.trainer.resume)
        why = problem(path)  # digests and ds/ pickles checked before any rank starts, before anything is loaded
        if why is not None:
            newest = latest_checkpoint(path.parent.parent)
            raise PlanError("trainer.resume", f"{why}; " + (f"the newest loadable checkpoint there is {newest}" if newest
                            else f"there is no loadable checkpoint in {path.parent}"))
    ckpt = CheckpointDir(path)
    meta = ckpt.meta()
    saved = saved_layout(meta["plan"])
    now = plan.layout()
    if saved != now and (max(saved["zero_stage"], now["zero_stage"]) > 2 or not ckpt.optim.is_dir()):
        raise PlanError("parallel", f"{path} was saved with {saved} but this run is {now}; changing the plan on "
                        "resume needs ZeRO <= 2 on both sides and the checkpoint's optim/ folder: resume with " +
                        " ".join(_override(k, v) for k, v in saved.items() if _configurable(cfg, k)))
    ckpt_config = json.loads((ckpt.hf / "config.json").read_text())
    _check_model_type(path, ckpt_config, hf_config)
    for key in family_of(cfg.model).shape_keys():
        if key in ckpt_config and getattr(hf_config, key, None) != ckpt_config[key]:
            raise PlanError(f"model.config.{key}", f"the checkpoint {path} has {key}={ckpt_config[key]} but the "
                            f"configured model has {getattr(hf_config, key, None)}; resume with the same model")
    saved_batch = meta["samples_seen"] // max(1, meta["step"])
    if saved_batch != plan.global_batch_size:
        raise PlanError("trainer.global_batch_size", f"{plan.global_batch_size} but {path} was trained with "
                        f"{saved_batch}; the data position and the schedule count steps of that size: "
                        f"resume with trainer.global_batch_size={saved_batch}")
    _check_tokenizer(cfg, path)
    if meta["step"] >= cfg.trainer.max_steps:
        raise PlanError("trainer.max_steps", f"{cfg.trainer.max_steps} but {path} is at step {meta['step']} "
                        "already; raise trainer.max_steps to train on")
    return path


def _note_latest_pointer(run_dir: Path) -> None:
    """``auto``: one line when ``checkpoints/latest`` names no checkpoint of the run (it is not what ``auto`` reads)."""
    why = latest_pointer_problem(run_dir)
    if why is not None:
        print(f"[hybridtrain] note: {why}; ignored (auto takes the newest loadable step_N)")


def _check_model_type(path: Path, ckpt_config: dict, hf_config) -> None:
    """The checkpoint's ``hf/config.json`` is of this run's model type (a gpt2 checkpoint resumed by a Llama
    recipe would fail in the ranks, loading a state dict of other names)."""
    saved, now = ckpt_config.get("model_type"), getattr(hf_config, "model_type", None)
    if saved is not None and now is not None and saved != now:
        raise PlanError("model.model_type", f"the checkpoint {path} is {saved} but this run's model is {now}; resume "
                        f"with the same model (the recipe that saved it, model.model_type={saved})")


TOKENIZER_PROBE = "The quick brown fox jumps over the lazy dog; 0123456789, naïve café, 日本語, <|endoftext|>\n"
"""Text both tokenizers encode in :func:`tokenizer_difference`: the same vocabulary with other merges or another
pre-tokenizer (a prefix space) splits it into other ids."""


def tokenizer_difference(saved: Path, now: Path) -> Optional[str]:
    """How ``tokenizer.json`` ``now`` maps text to other ids than ``saved`` (the first token whose id differs, or
    the probe text's encodings), or ``None`` when they agree: the same vocabulary with the same ids, and the same
    ids for :data:`TOKENIZER_PROBE`. Read with the ``tokenizers`` library, so formatting and file layout differences
    (``save_pretrained`` rewrites the file) do not count."""
    from tokenizers import Tokenizer

    a, b = Tokenizer.from_file(str(saved)), Tokenizer.from_file(str(now))
    va, vb = a.get_vocab(with_added_tokens=True), b.get_vocab(with_added_tokens=True)
    if va != vb:
        token = next((t for t, i in sorted(va.items(), key=lambda x: x[1]) if vb.get(t) != i), None)
        if token is None:
            token = next(t for t in vb if t not in va)
            return f"this run's has the token {token!r} (id {vb[token]}), which the checkpoint's has not"
        where = f"id {vb[token]}" if token in vb else "no id"
        return f"the token {token!r} is id {va[token]} in the checkpoint's but {where} in this run's"
    ia, ib = a.encode(TOKENIZER_PROBE).ids, b.encode(TOKENIZER_PROBE).ids
    if ia != ib:
        return f"the same vocabulary splits text differently (other merges or pre-tokenization): {ia[:8]} vs {ib[:8]}"
    return None


def _check_tokenizer(cfg: Config, path: Path) -> None:
    """The run's tokenizer gives the ids the checkpoint's model was trained on (its ``hf/tokenizer.json``): a
    tokenizer of the same size with other ids passes every shape check, and training on would unlearn the model.
    Refused rather than warned: the loss would only show it after the steps had already undone the training."""
    from hybridtrain.data.tokenizer import tokenizer_file

    own = CheckpointDir(path).hf
    saved, now = own / "tokenizer.json", tokenizer_file(cfg.data)
    if not saved.is_file() or not now.is_file():  # nothing to compare (a slow-only HF tokenizer folder)
        return
    why = tokenizer_difference(saved, now)
    if why is not None:
        raise PlanError("data.tokenizer", f"{now} is not the tokenizer the checkpoint {path} was trained with ({why}); "
                        f"resume with the checkpoint's own, data.tokenizer={own}, or start a new run")


def _checkpoint_folder(value: str) -> Path:
    """The folder ``trainer.resume=value`` names, or a :class:`PlanError` saying what the path is instead."""
    path = Path(value).expanduser().resolve()
    if path.is_dir():
        return path
    expected = "give a RUN_DIR/checkpoints/step_N folder (the one that holds meta.json) or auto"
    if path.is_file():
        inside = next((p for p in path.parents if CheckpointDir(p).meta_file.is_file()), None)
        hint = f"it lies inside the checkpoint {inside}: give that folder" if inside else expected
        size = path.stat().st_size
        raise PlanError("trainer.resume", f"{value!r} is a file ({size} bytes), not a checkpoint folder; {hint}")
    if path.exists():
        raise PlanError("trainer.resume", f"{value!r} is neither a folder nor a file; {expected}")
    raise PlanError("trainer.resume", f"{value!r} does not exist; {expected}")


def _configurable(cfg: Config, key: str) -> bool:
    """Whether a saved layout's entry has a ``parallel.*`` key to restore it with (an axis added since has
    none until its key exists)."""
    return key == "stage_bounds" or hasattr(cfg.parallel, key)


def _override(key: str, value) -> str:
    """The command-line override that restores one entry of a saved layout."""
    if key == "stage_bounds":  # saved as boundaries, configured as layers per stage
        return "parallel.stage_layers=[" + ",".join(str(b - a) for a, b in zip(value, value[1:])) + "]"
    return f"parallel.{key}={value}"


def data_note(checkpoint: Path, prepared) -> Optional[str]:
    """The one-line note when this run's data (``prepared``, :class:`hybridtrain.data.prepare.Prepared`)
    is not what ``checkpoint`` was trained on, by the content digests its ``meta.json`` records under
    ``data``; ``None`` when it is the same, or for a checkpoint saved before they were recorded."""
    from hybridtrain.data.prepare import data_changes

    saved = CheckpointDir(checkpoint).meta().get("data")
    if not isinstance(saved, dict) or not saved.get("inputs"):
        return None
    changes = data_changes(saved["inputs"], prepared.inputs)
    if not changes and saved.get("fingerprint") in ("", prepared.fingerprint):
        return None
    what = "; ".join(changes[:4]) + (f"; {len(changes) - 4} more" if len(changes) > 4 else "") if changes else \
        "same files, other data options"
    return (f"note: the training data changed since {checkpoint} ({what}); training continues from its data "
            f"position, which now refers to other samples")
