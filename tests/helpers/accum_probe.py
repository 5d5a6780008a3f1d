"""bf16 precision probe for ``tests/dist/test_bf16_accum.py`` (run as a script, one
rank on gloo): ``python tests/helpers/accum_probe.py MICRO_BATCHES`` prints one JSON object.

It builds hybridtrain's engine for ``gpt_tiny`` three times from the same seeded weights: fp32,
bf16 as shipped (fp32 gradient accumulation) and bf16 with DeepSpeed's default accumulation in bf16
(the ``data_types`` entry removed from the DeepSpeed config, as before the fix). Each engine runs
``MICRO_BATCHES`` micro-batches of the same random tokens (one optimizer step's worth, ``engine.step()``
after each backward as the training loop does, so the last is DeepSpeed's accumulation boundary); in
place of the optimizer's step (accumulated and reduced, not applied) DeepSpeed's ``safe_get_full_grad``
reads the gradient of every parameter. Printed per bf16 mode: the optimizer DeepSpeed chose and the
relative L2 distance of its gradient from the fp32 one, and the share of its elements that a bf16 value
holds exactly, zeros left out (1.0: the fp32-accumulated gradient was rounded to bf16 on the way). Then ``llama_tiny`` in bf16: the dtypes of its
parameters and of its RoPE ``inv_freq`` buffers (DeepSpeed >= 0.19.2 leaves buffers in fp32).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# run as a script: tests/, not this folder (its config.py, data.py would shadow top-level modules), so
# ``helpers`` imports as the package
sys.path[0] = str(Path(__file__).resolve().parents[1])


def main(micro_batches: int) -> dict:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    import importlib

    import deepspeed
    import torch

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # as the worker does
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.utils import safe_get_full_grad

    import hybridtrain.engine as engine_mod
    from hybridtrain.plan import resolve
    from hybridtrain.plan.types import Machine
    from helpers.config import compose

    seq = 32
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 8000, (1, seq + 1), generator=g) for _ in range(micro_batches)]
    shipped = engine_mod.ds_config

    def bf16_accumulation(cfg, plan, **kwargs):  # the DeepSpeed config before the fix
        conf = shipped(cfg, plan, **kwargs)
        conf.pop("data_types", None)
        return conf

    out: dict = {"micro_batches": micro_batches}
    grads: dict = {}
    for mode in ("fp32", "bf16", "bf16_accum_bf16"):
        cfg = compose("+recipe=gpt_tiny", f"trainer.precision={mode[:4]}", "parallel.dp=1",
                      f"trainer.global_batch_size={micro_batches}", "trainer.max_steps=1",
                      "optim.warmup_steps=1", "plan.calibrate=false")
        plan, hf = resolve(cfg, Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=1))
        engine_mod.ds_config = bf16_accumulation if mode == "bf16_accum_bf16" else shipped
        built = engine_mod.build(cfg, plan, hf)
        engine = built.engine
        built.stop_watching()
        weight = torch.tensor(micro_batches / (micro_batches * seq), dtype=torch.float32)
        total = 0.0
        seen: dict = {}

        def capture(*args, _engine=engine, _seen=seen, **kwargs):  # the optimizer's step, which would consume it
            _seen.update({n: safe_get_full_grad(p).float().clone() for n, p in _engine.module.named_parameters()})

        engine.optimizer.step = capture
        for i, ids in enumerate(batches):
            loss = engine(ids[:, :-1].contiguous(), (ids[:, 1:].contiguous(), weight))
            engine.backward(loss)  # the last one is the boundary: DeepSpeed reduces there, where it reduces
            engine.step()  # counts the micro-batch; at the boundary it calls the optimizer's step
            total += float(loss)
        assert seen, "the optimizer's step never ran"
        grads[mode] = seen  # accumulated and reduced, not applied
        out[mode] = {"zero_stage": plan.zero_stage, "optimizer": type(engine.optimizer).__name__,
                     "grad_accum_dtype": str(engine.get_data_types()[1]), "loss": total / micro_batches}
    # DeepSpeed >= 0.19.2 keeps buffers in their own dtype under bf16: Llama's RoPE inv_freq stays fp32
    cfg = compose("+recipe=llama_tiny", "trainer.precision=bf16", "parallel.dp=1", "plan.calibrate=false")
    plan, hf = resolve(cfg, Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=1))
    engine_mod.ds_config = shipped
    module = engine_mod.build(cfg, plan, hf).engine.module
    out["llama_buffers"] = {n: str(b.dtype) for n, b in module.named_buffers() if n.endswith("inv_freq")}
    out["llama_params"] = sorted({str(p.dtype) for p in module.parameters()})
    ref = grads["fp32"]
    for mode in ("bf16", "bf16_accum_bf16"):
        num = sum(float((grads[mode][n] - ref[n]).square().sum()) for n in ref)
        den = sum(float(ref[n].square().sum()) for n in ref)
        out[mode]["grad_rel_error"] = (num / den) ** 0.5
        # the share of gradient elements a bf16 value holds exactly: 1.0 when the fp32-accumulated gradient
        # was rounded to bf16 on the way (a bf16 all-reduce), near 0 for a gradient kept in fp32
        # (zeros, such as the rows of tokens no micro-batch holds, are exact either way and left out)
        nonzero = {n: grads[mode][n][grads[mode][n] != 0] for n in ref}
        exact = sum(int((g.bfloat16().float() == g).sum()) for g in nonzero.values())
        out[mode]["bf16_exact_share"] = exact / max(1, sum(g.numel() for g in nonzero.values()))
    return out


if __name__ == "__main__":
    print("ACCUM " + json.dumps(main(int(sys.argv[1]))), flush=True)
    sys.stdout.flush()
    os._exit(0)
