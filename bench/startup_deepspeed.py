"""The start-up baseline: a minimal hand-written DeepSpeed pipeline script, no hybridtrain.

    python -u -m deepspeed.launcher.runner --num_gpus PP --no_local_rank bench/startup_deepspeed.py OUT_DIR JSON

JSON holds the model shape and batch (``n_layer``, ``n_embd``, ``n_head``, ``n_positions``,
``vocab``, ``seq_len``, ``global_batch``, ``micro_batch``, ``pp``). It builds a GPT-2 of that shape
from HF's ``GPT2Block`` inside a DeepSpeed ``PipelineModule``, initialises the engine with AdamW
and trains one step on random tokens; rank 0 prints its phase times and writes
``OUT_DIR/first_step.json``. This is what a user writing DeepSpeed by hand would run; the
benchmark compares hybridtrain's launch-to-first-step with it. Like hybridtrain's worker it
skips DeepSpeed's JIT build of a shared-memory inference op on CPU (25 s once per machine), so
neither side pays for it.
"""
import json
import os
import sys
import time

T0 = time.perf_counter()
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


def main() -> None:
    out_dir, shape = sys.argv[1], json.loads(sys.argv[2])
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    import deepspeed
    import importlib
    from deepspeed.pipe import LayerSpec, PipelineModule
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    t_import = time.perf_counter() - T0
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    t_init = time.perf_counter() - T0
    cfg = GPT2Config(n_layer=shape["n_layer"], n_embd=shape["n_embd"], n_head=shape["n_head"],
                     n_positions=shape["n_positions"], vocab_size=shape["vocab"],
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.n_embd), nn.Embedding(cfg.n_positions, cfg.n_embd)

        def forward(self, ids):  # [B, S] -> [B, S, H]
            return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.block = GPT2Block(cfg, layer_idx=i)

        def forward(self, x):
            out = self.block(x)
            return out[0] if isinstance(out, tuple) else out

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_f, self.lm_head = nn.LayerNorm(cfg.n_embd), nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

        def forward(self, x):  # [B, S, H] -> [B, S, V]
            return self.lm_head(self.ln_f(x))

    def loss_fn(logits, labels):
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    layers = [LayerSpec(Embed)] + [LayerSpec(Block, i) for i in range(cfg.n_layer)] + [LayerSpec(Head)]
    model = PipelineModule(layers=layers, num_stages=shape["pp"], loss_fn=loss_fn, partition_method="uniform")
    ds_config = {"train_batch_size": shape["global_batch"], "train_micro_batch_size_per_gpu": shape["micro_batch"],
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                 "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    t_ready = time.perf_counter() - T0

    def batches():
        g = torch.Generator().manual_seed(0)
        while True:
            ids = torch.randint(0, cfg.vocab_size, (shape["micro_batch"], shape["seq_len"] + 1), generator=g)
            yield ids[:, :-1], ids[:, 1:]

    engine.train_batch(data_iter=batches())
    t_step = time.perf_counter() - T0
    if rank == 0:
        phases = {"imports": t_import, "init_distributed": t_init, "engine ready": t_ready, "first step": t_step}
        print(f"[ds-min] rank 0 phases since process start: {json.dumps(phases)}", flush=True)
        with open(os.path.join(out_dir, "first_step.json"), "w") as f:
            json.dump(phases, f)
        time.sleep(1.0)  # every process still alive while the benchmark reads their CPU times
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
