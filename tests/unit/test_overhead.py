"""What removed hybridtrain's per-step overhead stays removed, and the benchmark's models plan:
the blocks of a stage share one mask/rotary computation per micro-batch, the optimizer is torch's
fused AdamW (as the HF Trainer's), the no-op gradient reduction of one replica without ZeRO is off,
and every model of ``bench/models.py`` (a 49,152-token vocabulary over the 8,000-token embedded
tokenizer included) composes and plans."""
from __future__ import annotations

import pytest
import torch

from helpers.config import compose


def _sequential(*overrides: str):
    from hybridtrain.models.build import ModelBuilder
    from hybridtrain.models.stages import DecoderBlock, sequential_model
    from hybridtrain.parallel.context import TPContext
    from hybridtrain.parallel.layers import VocabParallelLoss
    from hybridtrain.plan import Machine, resolve

    cfg = compose(*overrides)
    plan, hf_config = resolve(cfg, Machine(cpu_cores=1))
    tp = TPContext()
    model = sequential_model(ModelBuilder.for_run(cfg, hf_config, tp, plan.padded_vocab_size),
                             VocabParallelLoss(plan.padded_vocab_size, tp))
    return model, [m for m in model.layers if isinstance(m, DecoderBlock)], plan


@pytest.mark.parametrize("recipe", ["llama_tiny", "gpt_tiny"])
def test_blocks_share_one_mask_and_rotary_per_micro_batch(recipe, monkeypatch):
    from hybridtrain.models.stages import BlockInputs

    model, blocks, plan = _sequential(f"+recipe={recipe}", "parallel.activation_checkpointing=true")
    assert len(blocks) == 4 and len({id(b.inputs) for b in blocks}) == 1
    made = []
    real = BlockInputs._make
    monkeypatch.setattr(BlockInputs, "_make", lambda self, *a: made.append(a[0].shape) or real(self, *a))
    ids = torch.randint(0, plan.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))  # [B, S]
    pos = torch.arange(16).expand(2, 16)  # the position ids a micro-batch carries through the stage
    model.logits((ids, pos)).sum().backward()  # 4 blocks, forward and the checkpointed recompute: once
    assert len(made) == 1
    model.logits((ids, pos.clone()))  # the next micro-batch (its own position ids): made again
    model.logits((ids[:, :8], pos[:, :8].clone()))  # another shape
    assert [tuple(s[:2]) for s in made] == [(2, 16), (2, 16), (2, 8)]


def test_blocks_share_mask_and_rotary_tensors():
    _, blocks, _ = _sequential("+recipe=llama_tiny")
    hidden, pos = torch.zeros(1, 8, 96), torch.arange(8)[None]  # [B, S, H], [B, S]
    first = blocks[0].inputs(hidden, pos, blocks[0].sliding, blocks[0].rotary)
    last = blocks[-1].inputs(hidden, pos, blocks[-1].sliding, blocks[-1].rotary)
    assert first[1][0] is last[1][0] and first[0] is last[0]  # the same tensors, not recomputed
    assert not first[1][0].requires_grad


@pytest.mark.parametrize("fused", [True, False])
def test_fused_adamw_reaches_torch(fused):
    from hybridtrain.engine import ds_config
    from hybridtrain.plan import Machine, resolve

    cfg = compose("+recipe=gpt_tiny", f"optim.fused={str(fused).lower()}")
    plan, _ = resolve(cfg, Machine(cpu_cores=1))
    params = ds_config(cfg, plan)["optimizer"]["params"]
    assert params["torch_adam"] is True and params["fused"] is fused  # DeepSpeed passes it to torch.optim.AdamW


def test_deepspeed_throughput_timer_off():
    """DeepSpeed's throughput timer synchronizes the device twice per micro-batch; hybridtrain never prints it."""
    from hybridtrain.engine import ds_config
    from hybridtrain.plan import Machine, resolve

    cfg = compose("+recipe=gpt_tiny", "parallel.pp=2")
    plan, _ = resolve(cfg, Machine(cpu_cores=2))
    assert ds_config(cfg, plan)["timers"] == {"throughput": {"enabled": False, "synchronized": False}}


def test_fused_is_the_default():
    assert compose("+recipe=gpt_tiny").optim.fused is True


@pytest.mark.parametrize("layout, zero, precision, skipped", [
    ((1, 1, 1), None, "fp32", True), ((1, 2, 2), None, "fp32", True), ((2, 1, 1), None, "fp32", False),
    ((2, 1, 1), 0, "fp32", False), ((1, 1, 1), 1, "fp32", False), ((1, 1, 1), 1, "bf16", True),
    ((1, 2, 2), 1, "bf16", True), ((2, 1, 1), 1, "bf16", False), ((1, 1, 1), 2, "bf16", False)])
def test_no_op_gradient_reduction_skipped_only_for_one_replica_all_reducing(layout, zero, precision, skipped):
    """One replica: ZeRO-0 and the BF16 optimizer (bf16 ZeRO-1) would all-reduce over a group of one; ZeRO's
    own optimizers move gradients into partitions while reducing, so they keep the reduction."""
    from hybridtrain.engine import reduces_gradients
    from hybridtrain.plan import Machine, resolve

    dp, tp, pp = layout
    cfg = compose("+recipe=llama_tiny", f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                  f"parallel.zero_stage={'null' if zero is None else zero}", f"trainer.precision={precision}")
    plan, _ = resolve(cfg, Machine(cpu_cores=8))
    assert reduces_gradients(plan) is not skipped


def test_bench_models_compose_and_plan():
    from bench.models import FAMILIES, MODELS
    from hybridtrain.plan import Machine, resolve

    for name, bm in MODELS.items():
        plan, hf = resolve(compose(*bm.overrides), Machine(cpu_cores=1))
        assert plan.tokens_per_step == bm.tokens_per_step, name
        assert plan.grad_accum == 8 and plan.micro_batch_size == 1, name
    plan, hf = resolve(compose(*MODELS["smollm2_135m"].overrides), Machine(cpu_cores=1))
    assert (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
            hf.intermediate_size, hf.vocab_size, hf.tie_word_embeddings) == (30, 576, 9, 3, 1536, 49152, True)
    assert plan.vocab_size == 49152  # larger than the embedded tokenizer's 8,000 tokens
    assert {compose(*MODELS[f].overrides).model.model_type for f in FAMILIES} == {"llama", "qwen2", "phi3"}


def test_loop_times_are_differences_of_elapsed():
    from bench.overhead import loop_times

    records = [{"step": s, "elapsed_s": e} for s, e in [(1, 5.0), (2, 6.5), (3, 8.0), (4, 10.0)]]
    records.insert(2, {"step": 2, "val_loss": 1.0})  # an evaluation record has no elapsed_s
    assert loop_times(records, skip=2) == [1.5, 2.0]


def test_profile_split_by_stack(tmp_path):
    from bench.profile_step import split

    loop = "main (hybridtrain/worker.py:1);train (hybridtrain/train/loop.py:90)"
    raw = tmp_path / "rank0.txt"
    raw.write_text("\n".join([
        f"{loop};_step_sequential (hybridtrain/train/loop.py:50);DeepSpeedEngine.step (deepspeed/runtime/engine.py:1);"
        "adamw (torch/optim/adamw.py:3) 6",
        f"{loop};_run (hybridtrain/models/stages.py:9);BlockInputs.__call__ (hybridtrain/models/stages.py:110) 1",
        f"{loop};Observer.finish (hybridtrain/observe/observer.py:200);loss (hybridtrain/report/plots.py:1) 50",
        "main (hybridtrain/worker.py:1);build (hybridtrain/engine/__init__.py:3) 9",  # outside the loop
        f"{loop};_step_sequential (hybridtrain/train/loop.py:50);helper (contextlib.py:1) 3"]))
    cats, rest, total = split(raw)
    assert total == 10 and cats == {"optimizer (AdamW)": 6, "positions, mask, rotary": 1}
    assert rest == {"helper (contextlib.py)": 3}
