"""The self-check of a derived family (``model.family=auto``): before anything launches, hybridtrain's
logits on a tiny random twin of the user's config, at tp = 1 (in this process) and tp = 2 (two spawned
gloo ranks), against transformers' own forward of the same twin.

The twin keeps the architecture (every flag of the config: biases, norms, soft-caps, multipliers,
sliding windows, the first layer types) and shrinks the sizes: 2-4 layers, 4 heads of 16, a
256-token vocabulary. Its weights are random and perturbed so that norms, biases and scales all
matter. A model-level operation the adapter misses (an embedding multiplier, logit scaling or
soft-capping in the head, an extra norm) or a config value read at forward time shows up as a
difference; the plan then refuses the model with the measured number.
"""
from __future__ import annotations

import copy
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

TOLERANCE = 1e-4
"""Largest accepted ``max |hybridtrain - transformers| / max |transformers|`` over the twin's logits."""
VOCAB, SEQ, BATCH = 256, 32, 2


class TwinFailed(RuntimeError):
    """transformers itself cannot run a tiny twin of the config (the config is inconsistent)."""


class AdapterFailed(RuntimeError):
    """hybridtrain's model of the twin, built with the derived adapter, raises where transformers' own forward runs
    (the model's modules take arguments or state the plans do not describe); the message names the exception."""


def twin_config(family: Any, hf_config: Any) -> Any:
    """A tiny copy of ``hf_config`` (see the module docstring)."""
    twin = copy.deepcopy(hf_config)
    layers = min(int(getattr(hf_config, family.n_layers)), 4 if getattr(hf_config, "layer_types", None) else 2)
    setattr(twin, family.n_layers, layers)
    if getattr(twin, "layer_types", None):
        twin.layer_types = list(twin.layer_types[:layers])
    heads, head_dim = 4, 16
    user_heads = int(getattr(hf_config, family.heads))
    user_head_dim = getattr(hf_config, "head_dim", None) or int(getattr(hf_config, family.hidden)) // user_heads
    # keep the user's hidden : heads x head_dim ratio (Gemma's is not 1), hidden a multiple of the heads
    ratio = int(getattr(hf_config, family.hidden)) / (user_heads * int(user_head_dim))
    grouped = family.kv_heads and (getattr(hf_config, family.kv_heads, None) or user_heads) < user_heads
    setattr(twin, family.heads, heads)
    if family.kv_heads and hasattr(twin, family.kv_heads):
        setattr(twin, family.kv_heads, 2 if grouped else heads)
    setattr(twin, family.hidden, heads * max(1, round(ratio * head_dim)))
    if getattr(twin, "head_dim", None):
        twin.head_dim = head_dim
    if hasattr(twin, family.mlp_width):
        setattr(twin, family.mlp_width, 128)
    setattr(twin, family.max_positions, max(SEQ, 64))
    if getattr(twin, "sliding_window", None):
        twin.sliding_window = min(int(twin.sliding_window), 8)
    twin.vocab_size = VOCAB
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(twin, key, None), int) and getattr(twin, key) >= VOCAB:
            setattr(twin, key, None)
    for key in family.dropout_keys:
        setattr(twin, key, 0.0)
    twin.use_cache = False
    return twin


def self_check(family: Any, hf_config: Any, tps: tuple[int, ...] = (1, 2)) -> dict[int, float]:
    """``{tp: max |hybridtrain - transformers| / max |transformers|}`` over the twin's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    twin = twin_config(family, hf_config)
    with tempfile.TemporaryDirectory(prefix="hybridtrain_selfcheck_") as tmp:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(twin, attn_implementation=twin._attn_implementation).eval()
        with torch.no_grad():  # unit norms and zero biases would hide a dropped or misplaced term
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(tmp)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            try:
                want = model(input_ids=ids).logits.float()
            except Exception as err:  # noqa: BLE001 - transformers' own model cannot run this config
                raise TwinFailed(f"transformers' own forward fails on a tiny twin of this config: "
                                 f"{type(err).__name__}: {err}") from None
        scale = float(want.abs().max())
        out: dict[int, float] = {}
        for tp in tps:
            if tp == 1:
                try:
                    got = _logits(Path(tmp), family, ids, _single(), twin._attn_implementation)
                except Exception as err:  # noqa: BLE001 - whatever the model's modules raise is the reason to refuse
                    raise AdapterFailed(f"hybridtrain's model of the twin fails at tp=1 where transformers' own "
                                        f"forward runs: {type(err).__name__}: {err}") from None
            else:
                from hybridtrain.parallel.spawn import run_world

                run = run_world(partial(_rank_logits, tmp, family, ids, twin._attn_implementation), tp, timeout_s=180)
                if run.problems or "logits" not in run.emitted[0]:
                    raise AdapterFailed(f"hybridtrain's model of the twin fails at tp={tp}: {run.problem_report()}")
                got = run.emitted[0]["logits"]
            out[tp] = float((got - want).abs().max()) / max(scale, 1e-12)
    return out


def _single():
    from hybridtrain.parallel.context import TPContext

    return TPContext()


def _logits(folder: Path, family: Any, ids, tp, attn: str) -> Any:
    """Full-vocabulary logits of hybridtrain's one-stage model of the twin in ``folder`` on this TP rank."""
    import torch
    from transformers import AutoConfig

    from hybridtrain.models.stages import sequential_model
    from hybridtrain.models.build import ModelBuilder
    from hybridtrain.models.hf_model import meta_model
    from hybridtrain.models.families import padded_vocab
    from hybridtrain.models.weights import SafetensorsWeights
    from hybridtrain.parallel.layers import VocabParallelLoss

    config = AutoConfig.from_pretrained(str(folder))
    config.use_cache = False
    config._attn_implementation = attn
    padded = padded_vocab(int(config.vocab_size), tp.size)
    builder = ModelBuilder(family=family, hf_config=config, hf_model=meta_model(config), seed=0, tp=tp,
                           padded_vocab=padded, weights=SafetensorsWeights(folder))
    model = sequential_model(builder, VocabParallelLoss(padded, tp)).eval()
    with torch.no_grad():
        shard = model.logits(ids).float()  # [B, S, V_pad / tp]
    if tp.size > 1:
        from hybridtrain.parallel import collectives

        shard = torch.cat(collectives.all_gather(shard, shard.device, group=tp.group), dim=-1)
    return shard[..., :int(config.vocab_size)]


def _rank_logits(folder: str, family: Any, ids, attn: str, rank: int, world: int, emit) -> None:
    """One rank of the tp = ``world`` check (:func:`hybridtrain.parallel.spawn.run_world` target)."""
    import torch.distributed as dist

    from hybridtrain.parallel.context import TPContext

    logits = _logits(Path(folder), family, ids, TPContext(group=dist.group.WORLD, rank=rank, size=world), attn)
    if rank == 0:
        emit("logits", logits)
