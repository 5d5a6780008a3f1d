"""Tiny HF checkpoints made with ``save_pretrained`` for the fine-tuning and export tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hybridtrain.data.embedded import TOKENIZER


def save_tokenizer(folder: Path) -> None:
    """The embedded BPE tokenizer as an HF tokenizer folder (tokenizer.json + config)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), eos_token="<|endoftext|>",
                                  bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok.save_pretrained(str(folder))


def make_checkpoint(folder: Path, family: str, seed: int = 7, sharded: bool = False) -> Path:
    """A small random HF model of ``family`` saved with ``save_pretrained`` (safetensors).

    ``llama``: grouped-query attention (12 heads, 6 KV heads), untied head; ``gpt2``: tied head.
    ``sharded`` writes several safetensors files with an index.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if family == "llama":
        cfg = AutoConfig.for_model("llama", vocab_size=8000, hidden_size=96, intermediate_size=192,
                                   num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=6,
                                   max_position_embeddings=256, tie_word_embeddings=False,
                                   bos_token_id=0, eos_token_id=0)
    else:
        cfg = AutoConfig.for_model("gpt2", vocab_size=8000, n_embd=96, n_layer=4, n_head=6, n_positions=256,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # make every tensor matter (norms and biases are 1/0 at init)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(str(folder), max_shard_size="300KB" if sharded else "5GB")
    save_tokenizer(folder)
    return folder


def save_vision_language(folder: Path, model_type: str, text_config: dict, **config):
    """``save_pretrained`` of a tiny vision-language model of ``model_type`` (``AutoModelForImageTextToText``)
    whose language model is ``text_config`` (the embedded tokenizer's vocabulary; perturbed weights, seed 5), plus
    the embedded tokenizer; ``config``: the rest of its configuration (the vision tower's). Returns the model in
    eval mode, the oracle of the folder's language model on text."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from helpers.families import VOCAB

    text = dict(text_config, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(5)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type, text_config=text, **config))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(folder))
    save_tokenizer(folder)
    return model.eval()


def hf_loss(folder: Path, input_ids: np.ndarray, labels: np.ndarray) -> float:
    """transformers' own loss of the model in ``folder`` on one batch (labels already shifted)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    x, y = torch.from_numpy(input_ids), torch.from_numpy(labels)
    with torch.no_grad():
        return float(model(input_ids=x, labels=y, shift_labels=y).loss)
