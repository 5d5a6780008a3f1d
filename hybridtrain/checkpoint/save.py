"""The collective save every rank calls (see :mod:`hybridtrain.checkpoint.io` for the layout)."""
from __future__ import annotations

import json
import math
import random
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Optional

from hybridtrain.checkpoint.hf_state import full_moment, gathered, hf_shape
from hybridtrain.checkpoint.reshard import MOMENTS, relink_zero_state
from hybridtrain.checkpoint.io import (DIGESTS, DS_TAG, CheckpointDir, CheckpointError, file_digests, file_sizes,
                                      finalize, foreign_pickle, read_meta, step_dir, tmp_dir, verify_share,
                                      write_hf_metadata)
from hybridtrain.checkpoint.space import is_disk_full, mount_point, no_space, space_problem
from hybridtrain.models.lora import is_lora, peft_name
from hybridtrain.rundir import RunDir


def stage_hf_params(module, include_replicas: bool = False) -> list:
    """``(hf_name, param, split)`` of every HF tensor this rank holds, in module order; the tied
    embedding copy of the last pipeline stage only with ``include_replicas``."""
    return [x for m in module.modules() if hasattr(m, "hf_params") for x in m.hf_params(include_replicas)]


def stage_hf_buffers(module) -> list:
    """``(hf_name, tensor)`` of the persistent buffers a checkpoint keeps that this rank's stage holds
    (``Family.saved_buffers``, DeepSeek-V3's router bias; replicated, so any rank's copy is the model's)."""
    return [x for m in module.modules() if hasattr(m, "hf_buffers") for x in m.hf_buffers()]


def save_checkpoint(built, cfg, plan, hf_config, step: int, run_dir: Path, tokenizer_path: Path,
                    extra: Callable[[Path], None] | None = None) -> Path:
    """Write ``RUN_DIR/checkpoints/step_<step>`` atomically; every rank must call it.

    ``extra(tmp_dir)``, called on every rank before the checkpoint is sealed, may add files (such as
    :mod:`hybridtrain.train.logits`); they are size-checked and digested like the rest. The free space
    is checked first (:class:`CheckpointError` on every rank, nothing written); a rank whose write
    fails removes the partial folder before it raises (a full disk: :class:`CheckpointError` naming it).
    """
    import torch.distributed as dist

    from hybridtrain.parallel import collectives

    final = step_dir(run_dir, step)
    tmp = tmp_dir(final)
    rank = dist.get_rank()
    device = built.engine.device
    stage = StageFiles.of(built, plan)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that was killed: its space comes back
    need = _check_space(built, plan, final, stage.bytes() if stage.writes else 0)  # collective
    try:
        _write(built, cfg, plan, hf_config, step, run_dir, tokenizer_path, extra, tmp, final, rank, stage)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a partial folder filling the disk
        if is_disk_full(err):
            raise CheckpointError(f"saving {final} failed: {no_space(mount_point(final.parent), need, during=True)}") from err
        raise
    collectives.barrier(device)
    return final


class StageFiles:
    """What a pipeline stage writes beside DeepSpeed's state: its HF-named fp32 weights (``hf/``), a LoRA
    run's adapters under peft's names (``adapter/``) and, with ZeRO <= 2, the AdamW moments of the trained
    parameters under HF names (``optim/``, what a resume under another plan reads).

    Data-axis rank 0's (``dp x cp``) TP rank 0 of each stage writes them (:attr:`writes`). The tensors are gathered
    to it one at a time and streamed into their files (:class:`~hybridtrain.checkpoint.stream.StreamedSafetensors`):
    no rank holds the stage's state on the host, the writer one full tensor at a time. With ``parallel.ep`` > 1
    every MoE layer's experts are gathered over the writer's expert-parallel group first (data ranks
    ``0 .. ep - 1``, each holding ``E / ep`` of them), so the files hold all ``E`` whichever rank trained them."""

    def __init__(self, built, plan, named: list, trained: list, buffers: list = ()):
        self.built, self.named, self.trained, self.buffers = built, named, trained, list(buffers)
        self.writes = built.tp_rank == 0 and built.data_rank == 0 and bool(named)
        size, ep = built.tp.size, built.ep.size
        self.weights = {n: hf_shape(p, s, size, ep) for n, p, s in named if not is_lora(n)}
        self.weights.update({n: tuple(b.shape) for n, b in self.buffers})
        self.adapters = {peft_name(n): hf_shape(p, s, size) for n, p, s in named if is_lora(n)}  # peft's names
        self.moments = {f"{key}.{n}": hf_shape(p, s, size, ep) for key in MOMENTS for n, p, s in trained}

    @classmethod
    def of(cls, built, plan) -> "StageFiles":
        """The files of ``built``'s stage under ``plan``."""
        named = stage_hf_params(built.engine.module)
        trained = [x for x in named if x[1].requires_grad] if plan.zero_stage <= 2 else []  # a frozen LoRA base: none
        return cls(built, plan, named, trained, stage_hf_buffers(built.engine.module))

    def bytes(self) -> int:
        """The bytes of the tensors the writer writes (fp32), known before any is gathered."""
        return 4 * sum(math.prod(shape) for part in (self.weights, self.adapters, self.moments) for shape in part.values())

    def write(self, ckpt: CheckpointDir) -> None:
        """Gather and write (every rank of the stage calls it; only :attr:`writes` writes)."""
        import torch

        from hybridtrain.checkpoint.stream import StreamedSafetensors

        built, stage = self.built, self.built.stage
        gathers = built.data_rank == 0  # only the writer's TP group gathers over TP
        ep = dict(ep=built.ep, ep_gathers=built.data_rank < built.ep.size)  # the writer's expert-parallel group
        parts = [(ckpt.hf_part(stage), self.weights), (ckpt.adapter_part(stage), self.adapters),
                 (ckpt.optim_part(stage), self.moments)]
        with ExitStack() as stack:
            hf, adapter, optim = [stack.enter_context(StreamedSafetensors(
                path, {n: (shape, torch.float32) for n, shape in specs.items()}, {"format": "pt"}))
                if self.writes and specs else None for path, specs in parts]
            for name, tensor in gathered(self.named, built.tp, built.engine.device, gathers, **ep):
                if tensor is not None:
                    (adapter.write(peft_name(name), tensor) if is_lora(name) else hf.write(name, tensor))
            for name, buffer in self.buffers if self.writes else ():  # whole on every rank: the writer's own
                hf.write(name, buffer.detach().float().cpu())
            if self.trained:
                relink_zero_state(built.engine.optimizer)
            for key in MOMENTS if self.trained else ():
                value = lambda p, key=key: full_moment(built.engine, p, key)  # noqa: E731
                for name, tensor in gathered(self.trained, built.tp, built.engine.device, gathers, value, **ep):
                    if tensor is not None:
                        optim.write(f"{key}.{name}", tensor)


def _check_space(built, plan, final: Path, own: int) -> int:
    """Refuse the save on every rank, before anything is written, when the checkpoint's file system
    lacks its size: DeepSpeed's part (the measured parameters, written by data-parallel rank 0 unless
    ZeRO-3 partitions them, and the optimizer state of every rank), the HF-named tensors, exactly, and
    the size of the last checkpoint of the same plan when larger. ``own``: the bytes of this rank's
HF-named tensors. A collective; returns the bytes needed."""
    import torch

    from hybridtrain.parallel import collectives

    held = built.model_state_bytes
    ds = held["optim"] + (held["params"] if built.data_rank == 0 or plan.zero_stage == 3 else 0)
    ds = ds if writes_ds(built.ep.size) else 0
    total = collectives.all_reduce(torch.tensor([float(ds + own)], dtype=torch.float64), built.engine.device)
    need = int(float(total.item()) * 1.05) + SLACK_BYTES
    need = max(need, _last_size(final.parent, plan))
    why = space_problem(final.parent, need)
    flag = torch.tensor([1.0 if why else 0.0])
    if collectives.all_reduce(flag, built.engine.device, op="max").item() > 0:
        raise CheckpointError(f"cannot save {final}: {why or 'another rank found no space left for it'}", shared=True)
    return need


def writes_ds(ep: int) -> bool:
    """Whether a save at expert-parallel degree ``ep`` writes DeepSpeed's own state (``ds/``): not at ``parallel.ep`` > 1, where every
    resume goes through ``hf/`` and ``optim/`` (``ds/`` would hold data rank 0's experts only) and the step and
    schedule come from ``meta.json``; its pickles, about 12 bytes per parameter, were written for no reader
    (gpu-review-3 finding 5)."""
    return ep == 1


SLACK_BYTES = 4 << 20
"""Added to the tensors' bytes: configs, the tokenizer, RNG states, DeepSpeed's scripts."""


def _last_size(root: Path, plan) -> int:
    """The bytes of the newest checkpoint in ``root`` saved under the same plan (0: none)."""
    pointer = root / "latest"
    try:
        meta = read_meta(root / pointer.read_text().strip())
    except (OSError, ValueError):
        return 0
    return sum(meta.get("files", {}).values()) if meta.get("plan") == plan.layout() else 0


def _write(built, cfg, plan, hf_config, step: int, run_dir: Path, tokenizer_path: Path, extra, tmp: Path,
           final: Path, rank: int, stage: StageFiles) -> None:
    """Every rank's writes into ``tmp``; rank 0 then seals (sizes, digests, ``meta.json``) and publishes."""
    from hybridtrain.parallel import collectives

    ckpt = CheckpointDir(tmp)
    lora = built.lora
    if rank == 0:
        ckpt.hf.mkdir(parents=True)
        ckpt.rng.mkdir()
        ckpt.optim.mkdir()
        if lora is not None:
            ckpt.adapter.mkdir()
    device = built.engine.device
    collectives.barrier(device)
    client = {"hybridtrain": {"step": step, "samples_seen": step * plan.global_batch_size}}
    if writes_ds(built.ep.size):
        built.engine.save_checkpoint(str(tmp), tag=DS_TAG, client_state=client, save_latest=False)
    stage.write(ckpt)  # collective over the stage's TP and DP groups
    save_rng(ckpt.rng_file(rank))
    if extra is not None:
        extra(tmp)
    collectives.barrier(device)
    if rank == 0:
        run = RunDir(run_dir)
        if str(cfg.finetune.objective) == "reward":  # a ...ForSequenceClassification folder, pooling at the pad id
            from hybridtrain.plan.reward import classifier_config

            pad_id = json.loads(run.data_file.read_text()).get("pad_id", 0) if run.data_file.is_file() else 0
            hf_config = classifier_config(hf_config, pad_id)
        write_hf_metadata(ckpt.hf, hf_config, tokenizer_path)
        if lora is not None:
            write_adapter_config(ckpt.adapter, lora, cfg, hf_config)
        shutil.copy2(run.config_file, ckpt.config_file)
        shutil.copy2(run.plan_file, ckpt.plan_file)
        meta = {"step": step, "samples_seen": step * plan.global_batch_size,
                "plan": plan.layout(),
                "files": file_sizes(tmp),  # lets a resume detect a truncated or missing file
                DIGESTS: file_digests(tmp)}  # and one changed at the same size: verified before any load
        if (data := data_record(run)) is not None:  # the data by content: a resume says when it changed
            meta["data"] = data
        ckpt.meta_file.write_text(json.dumps(meta, indent=1))  # last: marks the checkpoint complete
        finalize(tmp, final, cfg.trainer.keep_last)


def data_record(run: RunDir) -> Optional[dict]:
    """``meta.json``'s ``data``: the run's data fingerprint and its inputs by content (``data.json``'s
    ``fingerprint`` and ``inputs``), which :func:`hybridtrain.checkpoint.resume.data_note` compares at
    resume; ``None`` without a ``data.json``."""
    if not run.data_file.is_file():
        return None
    data = json.loads(run.data_file.read_text())
    return {"fingerprint": data.get("fingerprint", ""), "inputs": data.get("inputs", {})}


def rng_state() -> tuple[dict, dict]:
    """This rank's RNG states as safetensors' ``(tensors, metadata)``: torch's CPU generator, its CUDA
    device's (dropout on a GPU draws from that one), numpy's and Python's Mersenne twisters (their
    words as int64 tensors, the scalars as JSON). Tensors and strings only: loading never runs code."""
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, gauss_next = random.getstate()
    tensors = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
               "python_words": torch.tensor(words, dtype=torch.int64)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
    scalars = {"numpy": [kind, int(pos), int(has_gauss), float(gauss).hex()],
               "python": [version, None if gauss_next is None else float(gauss_next).hex()]}
    return tensors, {"rng": json.dumps(scalars)}


def set_rng_state(tensors: dict, metadata: dict) -> None:
    """Put back what :func:`rng_state` returned; a CUDA state is restored only where CUDA runs."""
    import numpy as np
    import torch

    scalars = json.loads(metadata["rng"])
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    kind, pos, has_gauss, gauss = scalars["numpy"]
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, float.fromhex(gauss)))
    version, gauss_next = scalars["python"]
    random.setstate((version, tuple(int(w) for w in tensors["python_words"].tolist()),
                     None if gauss_next is None else float.fromhex(gauss_next)))


def save_rng(path: Path) -> None:
    """Write this rank's RNG states to ``path`` (safetensors)."""
    from hybridtrain.checkpoint.stream import save_tensors

    tensors, metadata = rng_state()
    save_tensors(tensors, path, metadata)


def load_rng(path: Path) -> tuple[dict, dict]:
    """The ``(tensors, metadata)`` of an RNG file :func:`save_rng` wrote (safetensors: never runs code)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def write_adapter_config(folder: Path, lora, cfg, hf_config) -> None:
    """peft's ``adapter_config.json`` of a LoRA run into ``folder``; its base model is ``model.pretrained``
    (as an absolute path), or none for a seeded initialisation."""
    from hybridtrain.models.families import family_of
    from hybridtrain.models.lora import ADAPTER_CONFIG, adapter_config

    conv1d = any(rule.conv1d for rule in family_of(cfg.model).tp_plan.values())
    base = str(Path(cfg.model.pretrained).expanduser().resolve()) if cfg.model.pretrained else None
    (Path(folder) / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(lora, conv1d, base), indent=2))


def restore_rng(path: Path, rank: int) -> None:
    """Put back the RNG states rank ``rank`` saved in checkpoint ``path`` (if it saved any)."""
    f = CheckpointDir(path).rng_file(rank)
    if f.is_file():
        set_rng_state(*load_rng(f))


def load_verified(built, checkpoint: Path, rank: int, world: int) -> None:
    """Same-plan resume: verify ``ds/`` against the digests of ``meta.json`` and scan its pickles for anything
    DeepSpeed does not save (each rank its share of the files, then all agree), then let DeepSpeed load it
    weights-only (:mod:`hybridtrain.checkpoint.safe_load`) and put back this rank's RNG states.

    No rank opens a ``ds/`` file before every rank has found its share intact; DeepSpeed's own
    ``torch.load(weights_only=False)`` is never called. A collective."""
    import torch

    from hybridtrain.checkpoint.safe_load import ForeignPickleError, loading_safely
    from hybridtrain.parallel import collectives

    why = verify_share(checkpoint, DS_TAG, rank, world)
    if why is None:
        mine = [rel for rel in sorted(read_meta(checkpoint)[DIGESTS]) if rel.startswith(f"{DS_TAG}/")][rank::world]
        why = foreign_pickle(checkpoint, mine)
    flag = torch.tensor([1.0 if why else 0.0])
    if collectives.all_reduce(flag, built.engine.device, op="max").item() > 0:
        raise CheckpointError(f"refusing to load {checkpoint}: {why or 'another rank found a file that does not match'}",
                              shared=why is None)
    try:
        with loading_safely(built.engine):
            built.engine.load_checkpoint(str(checkpoint), tag=DS_TAG)
    except ForeignPickleError as err:  # a file changed after the scans: one line naming it, nothing of it ran
        raise CheckpointError(str(err)) from None
    restore_rng(checkpoint, rank)
