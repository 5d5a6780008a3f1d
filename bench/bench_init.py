"""Start-up cost of a rank: seconds to build its shard of one decoder block (and of the embedding) from the
seeded initialisation, for a Llama-2-7B-shaped (or 70B-shaped) model at a given tp.

``python -m bench.bench_init --tp 8 --rounds 3`` times ``ModelBuilder.block(0)`` and
``ModelBuilder.vocab_shard`` of TP rank 0 (no process group is needed to build: the TP collectives only
run in the forward). Run it from two checkouts side by side to compare (the machine is shared: judge
by the ratio of runs that alternate, not by absolute seconds)::

    python -m bench.bench_init --tp 8                    # this checkout
    PYTHONPATH=/other/checkout python bench/bench_init.py --tp 8
"""
from __future__ import annotations

import argparse
import statistics
import time

SHAPES = {
    "7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
           "tie_word_embeddings": False},
    "70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
            "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
            "tie_word_embeddings": False},
}


def build_times(shape: str, tp: int, rank: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per round to build block 0 and the embedding shard of TP rank ``rank``."""
    import torch

    from hybridtrain.models.build import ModelBuilder
    from hybridtrain.models.hf_model import hf_config_of, meta_model
    from hybridtrain.models.families import get_family, padded_vocab
    from hybridtrain.parallel.context import TPContext

    torch.set_num_threads(1)
    config = hf_config_of("llama", SHAPES[shape], SHAPES[shape]["vocab_size"], "sdpa")
    family = get_family("llama")
    out: dict[str, list[float]] = {"block": [], "embed": []}
    for _ in range(rounds):
        builder = ModelBuilder(family=family, hf_config=config, hf_model=meta_model(config), seed=1234,
                               tp=TPContext(rank=rank, size=tp), padded_vocab=padded_vocab(32000, tp, 16))
        t0 = time.perf_counter()
        builder.block(0)
        t1 = time.perf_counter()
        builder.vocab_shard(family.embed)
        out["block"].append(t1 - t0)
        out["embed"].append(time.perf_counter() - t1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import hybridtrain

    times = build_times(args.shape, args.tp, args.rank, args.rounds)
    print(f"{hybridtrain.__file__}: {args.shape} tp={args.tp} rank {args.rank}: block "
          f"{statistics.median(times['block']):.3f} s, embedding {statistics.median(times['embed']):.3f} s "
          f"(median of {args.rounds}; all: {[round(t, 3) for t in times['block']]})", flush=True)


if __name__ == "__main__":
    main()
