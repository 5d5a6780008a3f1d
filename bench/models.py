"""The models of the benchmarks, by name: Hydra overrides built from a config (nothing is downloaded).

``gpt_192`` is the suite's model (``gpt_tiny`` widened to 192), ``gpt_tiny`` its quick twin;
``smollm2_135m`` is a real model's shape (SmolLM2-135M: a Llama with 30 blocks, width 576, 9 query
/ 3 KV heads, MLP 1536, a tied 49,152-token vocabulary; random weights), where per-block and
per-micro-batch costs show as they do for users; ``llama_192``, ``qwen2_192`` and ``phi3_192`` are
small models of three families (Qwen2: biases on q, k, v; Phi-3: fused ``qkv_proj`` and
``gate_up_proj``) for the per-family overhead check.

The embedded tokenizer has 8,000 tokens; a model vocabulary larger than the tokenizer's (49,152
here) is accepted, the rows past 8,000 are never looked up but their logits are computed, as when
fine-tuning a model whose tokenizer is smaller than its embedding.
"""
from __future__ import annotations

from dataclasses import dataclass, field

STEP = ["data.seq_len=128", "trainer.global_batch_size=8", "parallel.micro_batch_size=1", "optim.warmup_steps=2",
        "trainer.save_final=false"]
"""8 sequences of 128 tokens a step, 8 micro-batches of 1 accumulated."""


@dataclass(frozen=True)
class BenchModel:
    """A benchmark model and how long to run it."""

    overrides: list[str]
    """Hydra overrides that select and shape the model and the batch."""
    tokens_per_step: int
    steps: int
    """Optimizer steps per run."""
    skip: int
    """Warm-up steps left out of the measured step time."""
    targets: dict[str, float] = field(default_factory=dict)
    """Least hybridtrain tokens/s over each baseline's tokens/s (``plain``, ``trainer``)."""


def _family(model_type: str, extra: dict | None = None) -> list[str]:
    shape = {"hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 6,
             "num_key_value_heads": 2, "max_position_embeddings": 256, **(extra or {})}
    return [f"model={model_type}"] + [f"+model.config.{k}={v}" for k, v in shape.items()] + STEP


SMOLLM2 = ["+recipe=llama_tiny", "model.config.hidden_size=576", "model.config.intermediate_size=1536",
           "model.config.num_hidden_layers=30", "model.config.num_attention_heads=9",
           "model.config.num_key_value_heads=3", "+model.config.vocab_size=49152", "model.config.tie_word_embeddings=true",
           "model.config.max_position_embeddings=2048", "+model.config.rms_norm_eps=1e-5",
           "+model.config.rope_parameters.rope_theta=100000.0", "+model.config.rope_parameters.rope_type=default"] + STEP

MODELS: dict[str, BenchModel] = {
    "gpt_192": BenchModel(["+recipe=gpt_tiny", "model.config.n_embd=192"] + STEP, 8 * 128, 30, 3,
                          {"plain": 0.95}),
    "gpt_tiny": BenchModel(["+recipe=gpt_tiny", "data.seq_len=32", "trainer.global_batch_size=8",
                            "optim.warmup_steps=2", "trainer.save_final=false"], 8 * 32, 8, 3, {"plain": 0.95}),
    "smollm2_135m": BenchModel(SMOLLM2, 8 * 128, 8, 2, {"plain": 0.98, "trainer": 1.0}),
    "llama_192": BenchModel(_family("llama"), 8 * 128, 30, 3, {"plain": 0.95}),
    "qwen2_192": BenchModel(_family("qwen2"), 8 * 128, 30, 3, {"plain": 0.95}),
    "phi3_192": BenchModel(_family("phi3", {"pad_token_id": 0}), 8 * 128, 30, 3, {"plain": 0.95}),
}
"""Every benchmark model by name (``python -m bench.run --models NAME,...``)."""

FAMILIES = ["llama_192", "qwen2_192", "phi3_192"]
"""The per-family overhead check: Llama and two more families, one with fused projections."""


def quick_steps(model: BenchModel) -> tuple[int, int]:
    """``(steps, skip)`` of a ``--quick`` run: fewer steps, at least two measured."""
    skip = min(model.skip, 2)
    return max(skip + 2, min(model.steps, 6)), skip
