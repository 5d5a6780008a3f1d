"""The fixed choices of the config: keys whose value is one of a few names.

OmegaConf checks an ``Enum``-typed field while Hydra composes, so ``trainer.precision=fp33`` fails
before anything runs. Each member's name equals its value (OmegaConf converts the text given on the
command line by name). The members are ``str``: they compare, hash, format and dump (JSON, YAML)
exactly as their value, so ``plan.precision == "bf16"`` and ``plan.json`` work unchanged.
"""
from __future__ import annotations

from enum import Enum

from hybridtrain.gpus import GPU_TYPES


class Choice(str, Enum):
    """One value of a fixed choice; ``str()`` and ``format()`` give the value (``bf16``), not
    ``Precision.bf16`` (Python's ``StrEnum`` does this too, but only from Python 3.11 on)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Precision(Choice):
    """``trainer.precision``: DeepSpeed's fp32, ``bf16`` or ``fp16`` mode."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class AttnImplementation(Choice):
    """``model.attn_implementation``: the HF attention kernel."""

    sdpa = "sdpa"
    eager = "eager"
    flash_attention_2 = "flash_attention_2"


class FamilyMode(Choice):
    """``model.family``: ``auto`` derives an adapter from transformers' plans (checked on a tiny twin)."""

    auto = "auto"


class Partition(Choice):
    """``parallel.partition``: how pipeline stage boundaries are chosen."""

    balanced = "balanced"
    blocks = "blocks"
    uniform = "uniform"
    parameters = "parameters"


class DataSource(Choice):
    """``data.source``: where the training records come from."""

    embedded = "embedded"
    files = "files"
    disk = "disk"
    hf = "hf"


class DataFormat(Choice):
    """``data.format``: what a record holds and which tokens carry the loss."""

    text = "text"
    chat = "chat"
    prompt_completion = "prompt_completion"
    preference = "preference"
    """``prompt``, ``chosen``, ``rejected`` (TRL's standard preference form), for ``finetune.objective=dpo``."""


class Packing(Choice):
    """``data.packing``: how records become rows of ``data.seq_len`` tokens (docs/data.md, "Packing").

    The config key also takes ``null`` (the format's default: :meth:`of`) and the old spellings
    ``true`` / ``false``; :meth:`of` turns each into a member.
    """

    documents = "documents"
    """Whole records placed into rows; positions restart and attention stays inside each record."""
    stream = "stream"
    """``text`` only: documents joined by EOS into one stream cut into rows; attention crosses documents."""
    none = "none"
    """One record per row, right-padded."""

    @classmethod
    def of(cls, value: object, data_format: str) -> "Packing":
        """The mode ``data.packing=value`` means for ``data.format=data_format``.

        ``null`` and ``true`` (the old "packed") are ``stream`` for ``text`` and ``documents`` for ``chat``
        and ``prompt_completion``; ``false`` is ``none``. :class:`ValueError` for anything else, and for
        ``stream`` with a format that has loss masks.
        """
        if isinstance(value, cls):
            return value
        text = str(value).strip().lower() if value is not None else "null"
        text_format = str(data_format) == "text"
        if text in ("null", "true"):
            return cls.stream if text_format else cls.documents
        if text == "false":
            return cls.none
        if text not in cls.__members__:
            raise ValueError(f"{value!r} is not one of [documents, stream, none] (or true / false / null)")
        if text == "stream" and not text_format:
            raise ValueError(f"stream joins documents into one token stream without loss masks, so it is for "
                             f"data.format=text only (this run: {data_format}); use data.packing=documents or none")
        return cls[text]


class SampleBy(Choice):
    """``data.sample_by``: what one record of a ``.txt`` file is."""

    document = "document"
    paragraph = "paragraph"
    line = "line"


class LauncherName(Choice):
    """``launcher.name``: set by the ``launcher`` group (``launcher=slurm``), never on its own."""

    local = "local"
    slurm = "slurm"
    multinode = "multinode"


class LoggerName(Choice):
    """``logger.name``: where rank 0 also sends the metrics."""

    none = "none"
    tensorboard = "tensorboard"
    wandb = "wandb"


class FinetuneMethod(Choice):
    """``finetune.method``: which parameters train."""

    full = "full"
    lora = "lora"


class Objective(Choice):
    """``finetune.objective``: what the loss is (``docs/preference.md``)."""

    sft = "sft"
    """The token cross-entropy of every data format."""
    dpo = "dpo"
    """Direct preference optimisation over ``data.format=preference`` pairs, TRL's ``DPOTrainer`` losses."""
    reward = "reward"
    """A Bradley-Terry reward model over ``data.format=preference`` pairs: a scalar head on each sequence's last
    token, TRL's ``RewardTrainer`` loss (``docs/preference.md#reward-models``)."""
    cpo = "cpo"
    """Contrastive preference optimisation (and SimPO), reference-free: TRL's ``CPOTrainer`` losses."""
    orpo = "orpo"
    """Odds-ratio preference optimisation, reference-free: TRL's ``ORPOTrainer`` loss."""


GpuType = Choice("GpuType", [(name, name) for name in GPU_TYPES], module=__name__, qualname="GpuType")
GpuType.__doc__ = ("``launcher.gpu_type``: the GPU model of a cluster's nodes (memory, bf16 support, peak "
                   "FLOP/s and links from the GPU table, :data:`hybridtrain.gpus.GPUS`).")
