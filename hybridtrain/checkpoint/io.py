"""Writing and finding checkpoints.

Layout of ``RUN_DIR/checkpoints/step_N/``::

    ds/            DeepSpeed's own state (module, ZeRO optimizer, lr scheduler) for exact resume
    hf/            HF-named fp32 weights, one safetensors file per pipeline stage, plus config.json,
                   generation_config.json and the tokenizer: what ``hybridtrain.export`` reads
    optim/         HF-named AdamW moments (ZeRO <= 2) of the trained parameters, read when resuming under
                   another plan
    adapter/       LoRA runs: the adapters under peft's names (``base_model.model.<module>.lora_A.weight``),
                   one safetensors file per stage, and peft's adapter_config.json
    rng/           every rank's RNG states (safetensors: tensors and JSON metadata, no pickle)
    config.yaml    the resolved config of the run that wrote it
    plan.json      its plan
    meta.json      step, samples seen, the size and sha256 digest of every other file; written last,
                   so its presence marks a complete checkpoint

DeepSpeed's ``ds/*.pt`` are pickles. They are opened with ``torch.load(weights_only=True)`` and an
allowlist of what DeepSpeed saves (:mod:`hybridtrain.checkpoint.safe_load`), and every file is verified
against the digests of ``meta.json`` before anything of the checkpoint is loaded (:func:`problem`, the
controller; :func:`verify_share` and :func:`foreign_pickle`, the ranks, just before DeepSpeed opens ``ds/``):
a file not listed there, with another digest, or whose pickle names anything outside the allowlist is
refused. hybridtrain's own files are safetensors, JSON and YAML, which never run code.

Everything is written into ``.tmp-step_N`` and renamed to ``step_N`` only when every rank has
finished; the ``latest`` pointer is replaced after that. A run killed during a save leaves only a
``.tmp-*`` folder, which is never loaded. These names are spelled in this module only (a
checkpoint folder's files: :class:`CheckpointDir`; the copies of ``config.yaml`` and ``plan.json``
keep the run directory's names, :mod:`hybridtrain.rundir`).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hybridtrain.checkpoint.safe_load import foreign_global, foreign_message
from hybridtrain.rundir import CONFIG, PLAN, RunDir

STEP_DIR = re.compile(r"^step_(\d+)$")
DS_TAG = "ds"
"""DeepSpeed's checkpoint tag: ``engine.save_checkpoint(path, tag=DS_TAG)`` writes ``path/ds/``."""
META = "meta.json"
LATEST = "latest"
"""``checkpoints/latest``: a text file naming the newest published ``step_N`` (for people and scripts)."""
DIGESTS = "sha256"
"""The ``meta.json`` key of every file's sha256 digest (``relative path -> hex``)."""
HF_PART = "model-stage{stage:03d}.safetensors"
OPTIM_PART = "optim-stage{stage:03d}.safetensors"
ADAPTER_PART = "adapter-stage{stage:03d}.safetensors"


@dataclass(frozen=True)
class CheckpointDir:
    """The files of the checkpoint folder ``path`` (layout in the module docstring)."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def ds(self) -> Path:
        """``ds/``: DeepSpeed's own state."""
        return self.path / DS_TAG

    @property
    def hf(self) -> Path:
        """``hf/``: HF-named weights per stage, HF config and tokenizer."""
        return self.path / "hf"

    @property
    def optim(self) -> Path:
        """``optim/``: HF-named AdamW moments per stage (ZeRO <= 2)."""
        return self.path / "optim"

    @property
    def adapter(self) -> Path:
        """``adapter/``: a LoRA run's adapters under peft's names per stage, and ``adapter_config.json``."""
        return self.path / "adapter"

    @property
    def rng(self) -> Path:
        """``rng/``: every rank's RNG states."""
        return self.path / "rng"

    @property
    def meta_file(self) -> Path:
        """``meta.json``: written last; its presence marks a complete checkpoint."""
        return self.path / META

    @property
    def config_file(self) -> Path:
        """The copy of the run's ``config.yaml``."""
        return self.path / CONFIG

    @property
    def plan_file(self) -> Path:
        """The copy of the run's ``plan.json``."""
        return self.path / PLAN

    def hf_part(self, stage: int) -> Path:
        """Pipeline stage ``stage``'s HF-named weights."""
        return self.hf / HF_PART.format(stage=stage)

    def hf_parts(self) -> list[Path]:
        """Every stage's HF-named weights, in stage order."""
        return sorted(self.hf.glob(HF_PART.replace("{stage:03d}", "*")))

    def optim_part(self, stage: int) -> Path:
        """Pipeline stage ``stage``'s HF-named AdamW moments."""
        return self.optim / OPTIM_PART.format(stage=stage)

    def adapter_part(self, stage: int) -> Path:
        """Pipeline stage ``stage``'s adapters (peft names)."""
        return self.adapter / ADAPTER_PART.format(stage=stage)

    def adapter_parts(self) -> list[Path]:
        """Every stage's adapters, in stage order (none: not a LoRA checkpoint)."""
        return sorted(self.adapter.glob(ADAPTER_PART.replace("{stage:03d}", "*")))

    def rng_file(self, rank: int) -> Path:
        """Rank ``rank``'s RNG states."""
        return self.rng / f"rank_{rank:05d}.safetensors"

    def meta(self) -> dict:
        """``meta.json``: step, samples seen, plan layout, file sizes. The one reader of it: a file that is not a
        JSON object (a save cut short by a full disk, an edit) is a :class:`MetaError`, never a ``JSONDecodeError``."""
        try:
            meta = json.loads(self.meta_file.read_text())
        except ValueError as err:  # JSONDecodeError, or bytes that are no UTF-8
            raise MetaError(f"{self.path} is not a complete checkpoint (meta.json is not valid JSON: {err}; cut short "
                            "or edited since the save)") from None
        if not isinstance(meta, dict):
            raise MetaError(f"{self.path} is not a complete checkpoint (meta.json holds a JSON "
                            f"{type(meta).__name__}, not the object a save writes)")
        return meta


def step_dir(run_dir: Path, step: int) -> Path:
    """``RUN_DIR/checkpoints/step_<step>``."""
    return RunDir(run_dir).checkpoints / f"step_{step}"


def tmp_dir(final: Path) -> Path:
    """Where the ranks write checkpoint ``final`` before it is published (never loaded)."""
    return final.with_name(f".tmp-{final.name}")


def is_complete(path: Path) -> bool:
    """A finished checkpoint folder (its ``meta.json`` is written last; ``hf/`` is in every save, ``ds/`` in those at
    ``parallel.ep`` = 1)."""
    ckpt = CheckpointDir(path)
    return ckpt.meta_file.is_file() and (ckpt.ds.is_dir() or ckpt.hf.is_dir())


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the file and the fix.

    ``shared``: every rank raises the same error (agreed through a collective), so one rank's
    message is enough."""

    def __init__(self, message: str, shared: bool = False):
        super().__init__(message)
        self.shared = shared


META_KEYS = ("step", "samples_seen", "plan")
"""The entries of ``meta.json`` a resume relies on (a save always writes them; :func:`problem` checks them)."""


class MetaError(CheckpointError, ValueError):
    """A ``meta.json`` that cannot be read as the object a save writes (:meth:`CheckpointDir.meta`). Also a
    ``ValueError``, which callers that treat an unreadable pointer as "no checkpoint" already catch."""


def checkpoint_files(folder: Path) -> list[str]:
    """Every file under ``folder`` but ``meta.json``, as sorted relative paths."""
    folder = Path(folder)
    return [str(p.relative_to(folder)) for p in sorted(folder.rglob("*")) if p.is_file() and p.name != META]


def file_sizes(folder: Path) -> dict[str, int]:
    """``relative path -> size`` of every file under ``folder`` (what ``meta.json`` records)."""
    return {rel: (Path(folder) / rel).stat().st_size for rel in checkpoint_files(folder)}


def sha256(path: Path) -> str:
    """The hex sha256 digest of file ``path``."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_digests(folder: Path, rels: Optional[list[str]] = None) -> dict[str, str]:
    """``relative path -> sha256`` of ``rels`` (default: every file but ``meta.json``) under ``folder``;
    several files at a time (hashlib releases the GIL), since a large model's ``ds/`` holds hundreds of GB."""
    folder = Path(folder)
    rels = checkpoint_files(folder) if rels is None else rels
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(rels, pool.map(lambda rel: sha256(folder / rel), rels)))


def _file_problem(path: Path, rel: str, meta: dict, digest: Optional[str] = None) -> Optional[str]:
    """Why file ``rel`` of checkpoint ``path`` does not match ``meta.json`` (``digest``: its sha256 when
    already computed), or ``None``."""
    f = Path(path) / rel
    if not f.is_file():
        return f"{f} is missing"
    size = meta.get("files", {}).get(rel)
    if size is not None and f.stat().st_size != size:
        return f"{f} is {f.stat().st_size} bytes but was saved with {size}: truncated or corrupt"
    if (digest or sha256(f)) != meta[DIGESTS][rel]:
        return f"{f} does not match its sha256 digest in meta.json: corrupt or replaced since the save"
    return None


def _listing_problem(path: Path, meta: dict, under: str = "") -> Optional[str]:
    """A checkpoint without digests, or a file (under ``under``) that ``meta.json`` does not list."""
    if DIGESTS not in meta:
        return (f"{path} has no file digests in meta.json (saved by a hybridtrain without them), so its "
                "DeepSpeed pickles cannot be verified before loading")
    prefix = f"{under}/" if under else ""
    unlisted = [rel for rel in checkpoint_files(path) if rel.startswith(prefix) and rel not in meta[DIGESTS]]
    if unlisted:
        return (f"{Path(path) / unlisted[0]} is not listed in meta.json: it was added after the save, "
                "and an unverified file is never loaded")
    return None


def problem(path: Path) -> Optional[str]:
    """Why checkpoint ``path`` cannot be loaded (incomplete, without digests, a file missing, added,
    truncated or not matching its sha256 digest, a ``ds/`` pickle naming anything DeepSpeed does not save),
    or ``None``. Reads every file once."""
    if not is_complete(path):
        return f"{path} is not a complete checkpoint (no meta.json: the save was interrupted)"
    try:
        meta = read_meta(path)
    except MetaError as err:
        return str(err)
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        return f"{path} is not a complete checkpoint (meta.json has no {', '.join(missing)}: edited since the save)"
    why = _listing_problem(path, meta)
    if why is not None:
        return why
    listed = sorted(meta[DIGESTS])
    for rel in listed:  # missing and truncated files first: no reading
        f = Path(path) / rel
        size = meta.get("files", {}).get(rel)
        if not f.is_file() or (size is not None and f.stat().st_size != size):
            return _file_problem(path, rel, meta)
    digests = file_digests(path, listed)
    for rel in listed:
        why = _file_problem(path, rel, meta, digests[rel])
        if why is not None:
            return why
    return foreign_pickle(path, [rel for rel in listed if rel.startswith(f"{DS_TAG}/")])


def foreign_pickle(path: Path, rels: list[str]) -> Optional[str]:
    """Why one of the ``ds/`` files ``rels`` of checkpoint ``path`` holds a pickled object outside what DeepSpeed
    saves (:mod:`hybridtrain.checkpoint.safe_load`; its digest cannot tell: a sender may rewrite meta.json), or
    ``None``. Reads each file's pickle, not its tensors."""
    for rel in rels:
        what = foreign_global(Path(path) / rel)
        if what is not None:
            return foreign_message(Path(path) / rel, what)
    return None


def verify_share(path: Path, under: str, rank: int, world: int) -> Optional[str]:
    """This rank's share (every ``world``-th file) of the digest check of the files under ``under``
    (``ds/``) of checkpoint ``path``, and the listing check; ``None`` when they match. The ranks
    split the reading; they must agree (a collective) before any of them loads."""
    meta = read_meta(path)
    why = _listing_problem(path, meta, under)
    if why is not None:
        return why
    mine = [rel for rel in sorted(meta[DIGESTS]) if rel.startswith(f"{under}/")][rank::world]
    return next((w for rel in mine if (w := _file_problem(path, rel, meta)) is not None), None)


def latest_checkpoint(run_dir: Path, skipped: Optional[list[str]] = None) -> Optional[Path]:
    """The newest loadable checkpoint of a run directory (:func:`problem`: its digests verified), or
    ``None``; the problems of newer ones that cannot be loaded are appended to ``skipped``."""
    root = RunDir(run_dir).checkpoints
    steps = sorted((int(m.group(1)), p) for p in root.glob("step_*") if (m := STEP_DIR.match(p.name)))
    for _, path in reversed(steps):
        why = problem(path)
        if why is None:
            return path
        if skipped is not None:
            skipped.append(why)
    return None


def latest_pointer_problem(run_dir: Path) -> Optional[str]:
    """Why ``checkpoints/latest`` of a run names no ``step_N`` folder of that run (rewritten by hand, copied from
    elsewhere), or ``None`` (also when there is no pointer). Nothing reads the pointer to resume (``auto`` takes
    the newest loadable ``step_N``, :func:`latest_checkpoint`); this says so when it is wrong."""
    pointer = RunDir(run_dir).checkpoints / LATEST
    if not pointer.exists() and not pointer.is_symlink():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, ValueError) as err:
        return f"{pointer} cannot be read ({type(err).__name__}: {err})"
    if not STEP_DIR.match(name) or not (pointer.parent / name).is_dir():
        return f"{pointer} names {name[:80]!r}, which is no step_N folder of this run"
    return None


def read_meta(path: Path) -> dict:
    """The ``meta.json`` of checkpoint ``path``."""
    return CheckpointDir(path).meta()


def save_tokenizer(tokenizer_path: Path, out: Path) -> None:
    """Write the run's tokenizer so that ``AutoTokenizer.from_pretrained(out)`` loads it."""
    from transformers import PreTrainedTokenizerFast

    from hybridtrain.data.embedded import EOS

    folder = tokenizer_path.parent
    if (folder / "tokenizer_config.json").is_file():  # an HF tokenizer folder: copy it as is
        for f in folder.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens_map", "chat_template")) and f.is_file():
                shutil.copy2(f, out / f.name)
        return
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path))
    if tok.convert_tokens_to_ids(EOS) is not None and EOS in tok.get_vocab():
        tok.eos_token = tok.bos_token = EOS
    tok.save_pretrained(str(out))


def write_hf_metadata(out: Path, hf_config, tokenizer_path: Path) -> None:
    """config.json, generation_config.json and the tokenizer of an HF model folder."""
    from transformers import GenerationConfig

    import copy

    hf_config = copy.deepcopy(hf_config)
    hf_config.use_cache = True  # training turns the KV cache off; generation wants it
    hf_config.save_pretrained(str(out))
    GenerationConfig.from_model_config(hf_config).save_pretrained(str(out))
    save_tokenizer(tokenizer_path, out)


def finalize(tmp: Path, final: Path, keep_last: Optional[int]) -> None:
    """Rank 0, after every rank wrote into ``tmp``: publish it as ``final``, move ``latest``, prune."""
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    pointer = final.parent / LATEST
    tmp_pointer = final.parent / ".latest.tmp"
    tmp_pointer.write_text(final.name)
    os.replace(tmp_pointer, pointer)
    if keep_last:
        steps = sorted((int(m.group(1)), p) for p in final.parent.glob("step_*") if (m := STEP_DIR.match(p.name)))
        for _, old in steps[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
