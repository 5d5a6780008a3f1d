"""The collective save every rank calls (see :mod:`hybridtrain.checkpoint.io` for the layout)."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Callable

from hybridtrain.checkpoint.hf_state import full_moment, gather
from hybridtrain.checkpoint.reshard import MOMENTS, relink_zero_state
from hybridtrain.checkpoint.io import (DS_TAG, CheckpointDir, file_sizes, finalize, step_dir, tmp_dir,
                                      write_hf_metadata)
from hybridtrain.models.lora import is_lora, peft_name
from hybridtrain.rundir import RunDir


def stage_hf_params(module, include_replicas: bool = False) -> list:
    """``(hf_name, param, split)`` of every HF tensor this rank holds, in module order; the tied
    embedding copy of the last pipeline stage only with ``include_replicas``."""
    return [x for m in module.modules() if hasattr(m, "hf_params") for x in m.hf_params(include_replicas)]


def save_checkpoint(built, cfg, plan, hf_config, step: int, run_dir: Path, tokenizer_path: Path,
                    extra: Callable[[Path], None] | None = None) -> Path:
    """Write ``RUN_DIR/checkpoints/step_<step>`` atomically; every rank must call it.

    ``extra(tmp_dir)``, called on every rank before the checkpoint is sealed, may add files (such as
    :mod:`hybridtrain.train.logits`); they are size-checked like the rest.
    """
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from hybridtrain.parallel import collectives

    final = step_dir(run_dir, step)
    tmp = tmp_dir(final)
    ckpt = CheckpointDir(tmp)
    rank = dist.get_rank()
    lora = built.lora
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        ckpt.hf.mkdir(parents=True)
        ckpt.rng.mkdir()
        ckpt.optim.mkdir()
        if lora is not None:
            ckpt.adapter.mkdir()
    device = built.engine.device
    collectives.barrier(device)
    client = {"hybridtrain": {"step": step, "samples_seen": step * plan.global_batch_size}}
    built.engine.save_checkpoint(str(tmp), tag=DS_TAG, client_state=client, save_latest=False)
    named = stage_hf_params(built.engine.module)
    tensors = gather(named, built.tp, device)  # collective over TP and DP
    adapters = {peft_name(n): tensors.pop(n) for n in list(tensors) if is_lora(n)}  # LoRA: peft's names
    moments = {}
    if plan.zero_stage <= 2:  # AdamW moments under HF names: what a resume under another plan reads
        relink_zero_state(built.engine.optimizer)
        trained = [x for x in named if x[1].requires_grad]  # a frozen LoRA base has none
        for key in MOMENTS:
            value = lambda p, key=key: full_moment(built.engine, p, key)  # noqa: E731
            moments.update({f"{key}.{n}": t for n, t in gather(trained, built.tp, device, value).items()})
    if built.tp_rank == 0 and built.dp_rank == 0 and (tensors or adapters):
        if tensors:
            save_file(tensors, str(ckpt.hf_part(built.stage)), metadata={"format": "pt"})
        if adapters:
            save_file(adapters, str(ckpt.adapter_part(built.stage)), metadata={"format": "pt"})
        if moments:
            save_file(moments, str(ckpt.optim_part(built.stage)), metadata={"format": "pt"})
    torch.save(rng_state(), ckpt.rng_file(rank))
    if extra is not None:
        extra(tmp)
    collectives.barrier(device)
    if rank == 0:
        write_hf_metadata(ckpt.hf, hf_config, tokenizer_path)
        if lora is not None:
            write_adapter_config(ckpt.adapter, lora, cfg, hf_config)
        run = RunDir(run_dir)
        shutil.copy2(run.config_file, ckpt.config_file)
        shutil.copy2(run.plan_file, ckpt.plan_file)
        meta = {"step": step, "samples_seen": step * plan.global_batch_size,
                "plan": plan.layout(),
                "files": file_sizes(tmp)}  # lets a resume detect a truncated or missing file
        ckpt.meta_file.write_text(json.dumps(meta, indent=1))  # last: marks the checkpoint complete
        finalize(tmp, final, cfg.trainer.keep_last)
    collectives.barrier(device)
    return final


def rng_state() -> dict:
    """This rank's RNG states: torch's CPU generator, its CUDA device's (dropout on a GPU draws
    from that one), numpy's and Python's."""
    import numpy as np
    import torch

    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda, "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    """Put back what :func:`rng_state` returned; a CUDA state is restored only where CUDA runs."""
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


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
    import torch

    f = CheckpointDir(path).rng_file(rank)
    if f.is_file():
        set_rng_state(torch.load(f, weights_only=False))  # our own file: numpy/python states are not tensors
