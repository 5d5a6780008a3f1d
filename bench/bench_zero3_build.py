"""Host memory of building a ZeRO-3 model at pp = 1: the peak resident memory of a rank when its model is
built (measured as ``deepspeed.initialize`` is entered, before DeepSpeed allocates optimizer state), with each layer partitioned as soon as it is built
(``engine.zero3_partitioner``) and, for comparison, with the whole model built first and partitioned by
``deepspeed.initialize`` (``--whole``).

``python -m bench.bench_zero3_build [--whole] [--layers 12 --width 1024]``: two CPU ranks (gloo), dp = 2,
fp32; prints each rank's peak RSS once the model is built and the fp32 size of the model.
"""
from __future__ import annotations

import argparse
import os
import resource
import socket


def _rank(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    import deepspeed
    import torch

    import hybridtrain.engine as engine
    from hybridtrain.cli import compose
    from hybridtrain.plan import Machine, resolve

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = compose(["+recipe=gpt_tiny", f"model.config.n_embd={args.width}", f"model.config.n_layer={args.layers}",
                   "model.config.n_head=8", "parallel.dp=2", "parallel.zero_stage=3", "trainer.global_batch_size=2"])
    plan, hf_config = resolve(cfg, Machine(cpu_cores=2))
    if args.whole:
        engine.zero3_partitioner = lambda *a, **k: None  # the model whole, then deepspeed.initialize
    initialize, at_initialize = deepspeed.initialize, []

    def measured(*a, **k):  # the peak of building the model, before DeepSpeed allocates optimizer state
        at_initialize.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        return initialize(*a, **k)

    deepspeed.initialize = measured
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    built = engine.build(cfg, plan, hf_config)
    params = sum(getattr(p, "ds_numel", p.numel()) for p in built.engine.module.parameters())
    out.put((rank, before, at_initialize[0], params))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--whole", action="store_true")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    for rank, before, peak, params in results:
        print(f"{'whole model, then deepspeed.initialize' if args.whole else 'layer by layer'}: rank {rank} peak RSS "
              f"{peak / 1024:.0f} MiB with the model built ({before / 1024:.0f} MiB before); model {params / 1e6:.1f}M "
              f"parameters = {4 * params / 2**20:.0f} MiB in fp32", flush=True)


if __name__ == "__main__":
    main()
