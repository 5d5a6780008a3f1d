"""The run's tokenizer: the embedded BPE, a ``tokenizer.json``, or an HF tokenizer folder.

Loaded as a transformers fast tokenizer so that chat templates (``apply_chat_template``) work;
the embedded tokenizer gets :data:`EMBEDDED_CHAT_TEMPLATE`, since ``tokenizer.json`` holds none.
"""
from __future__ import annotations

from pathlib import Path

from hybridtrain.config.schema import DataConfig
from hybridtrain.data.embedded import EOS, TOKENIZER

EMBEDDED_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>\n{% generation %}{{ message['content'] }}<|endoftext|>{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Chat template of the embedded tokenizer (and of ``tokenizer.json`` files without one):
``<|role|>`` then the content on the next line and a newline; an assistant turn ends with ``<|endoftext|>``
instead of the newline,
and its content plus that EOS are the generation (loss-carrying) tokens."""


def tokenizer_source(cfg: DataConfig) -> Path:
    """The tokenizer file or folder of ``data.tokenizer`` (the embedded ``tokenizer.json`` when null)."""
    if cfg.tokenizer is None:
        return TOKENIZER
    path = Path(cfg.tokenizer).expanduser()
    if path.is_file() or (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
        return path
    raise FileNotFoundError(f"data.tokenizer={cfg.tokenizer!r}: no tokenizer.json there; "
                            "give a tokenizer.json file or a folder holding one (or an HF tokenizer folder), "
                            "or null for the embedded one")


def tokenizer_file(cfg: DataConfig) -> Path:
    """The ``tokenizer.json`` of the run (what a checkpoint copies): the file itself, or the folder's."""
    path = tokenizer_source(cfg)
    return path / "tokenizer.json" if path.is_dir() else path


def load_tokenizer(cfg: DataConfig):
    """The run's ``PreTrainedTokenizerFast``, its EOS token set and (embedded) chat template attached."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = tokenizer_source(cfg)
    if path.is_dir() and (path / "tokenizer_config.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    else:
        tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json" if path.is_dir() else path))
    if tok.eos_token is None and tok.convert_tokens_to_ids(EOS) not in (None, tok.unk_token_id):
        tok.eos_token = EOS
    if not tok.chat_template and (cfg.tokenizer is None or not path.is_dir()):
        tok.chat_template = EMBEDDED_CHAT_TEMPLATE
    return tok


def vocab_size(cfg: DataConfig) -> int:
    """Size of the tokenizer's vocabulary, special tokens included."""
    return len(load_tokenizer(cfg))


def eos_id(cfg: DataConfig) -> int | None:
    """Id of the end-of-document token, or ``None`` if the tokenizer has none."""
    return load_tokenizer(cfg).eos_token_id
