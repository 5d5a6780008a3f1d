"""Typed schema of a hybridtrain run.

Hydra merges the YAML groups in ``conf/`` (and a ``+recipe=`` overlay) into these
dataclasses, so an unknown key or a wrong type is rejected before anything runs.
Library code receives the narrow sub-config it needs, never the whole tree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class ModelConfig:
    """Which HuggingFace causal LM to build."""

    model_type: str = "gpt2"
    """HF ``model_type`` of the architecture: ``gpt2`` or ``llama``."""
    config: Dict[str, Any] = field(default_factory=dict)
    """Overrides of the HF config under their HF names (``n_layer``, ``num_key_value_heads``...).
    ``vocab_size`` defaults to the tokenizer's vocabulary."""
    attn_implementation: str = "sdpa"
    """HF attention kernel: ``sdpa`` or ``eager``."""
    pretrained: Optional[str] = None
    """A local HF model folder (``save_pretrained``: config.json + safetensors) to fine-tune:
    weights only, fresh optimizer, step 0. Its config is the model (``model.config`` overrides
    non-shape keys such as dropout); its tokenizer is used unless ``data.tokenizer`` is set."""
    trust_remote_code: bool = False
    """Allow a ``model.pretrained`` folder's custom code. Off: only built-in HF architectures load."""
    vocab_pad_multiple: int = 1
    """The embedding and LM head are padded to a multiple of ``vocab_pad_multiple * parallel.tp``
    rows; the padded logits are masked, so padding never changes the loss."""


@dataclass
class ParallelConfig:
    """How the model and the batch are split over processes (world = dp x tp x pp)."""

    dp: Optional[int] = None
    """Data-parallel replicas. ``null``: whatever the launcher's devices leave after tp x pp
    (on machines without GPUs: one replica per node)."""
    tp: int = 1
    """Tensor-parallel degree: attention heads, MLP width and vocabulary are split Megatron-style."""
    pp: int = 1
    """Pipeline stages (DeepSpeed PipelineModule, 1F1B schedule). ``pp>1`` with one
    micro-batch per step is naive model parallelism."""
    micro_batch_size: int = 1
    """Samples per micro-batch on each data-parallel replica."""
    zero_stage: int = 1
    """DeepSpeed ZeRO stage over the data-parallel replicas: 0-3 with pp=1, 0-1 with pp>1."""
    partition: str = "blocks"
    """Pipeline stage boundaries: ``blocks`` (decoder blocks spread evenly, embedding on the first
    stage, norm and head on the last), ``uniform`` (every pipeline layer counts 1) or
    ``parameters`` (balance parameter counts)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward pass instead of storing them."""


@dataclass
class DataConfig:
    """Where training text comes from, how it is tokenized and how it is cut into samples.

    See ``docs/data.md``. Tokenization runs once in the launching process and is cached.
    """

    source: str = "embedded"
    """Where the records come from: ``embedded`` (the King James Bible shipped in the package),
    ``files`` (``data.path``: txt, json/jsonl, csv or parquet files), ``disk`` (``data.path``: a folder
    written by HF ``save_to_disk``) or ``hf`` (``data.name``: a hub dataset already in the local HF cache)."""
    path: Optional[str] = None
    """``files``: a path or glob (``corpus/*.jsonl``), several separated by commas; ``disk``: the
    ``save_to_disk`` folder. A ``save_to_disk`` folder given to ``files`` is loaded as ``disk``."""
    name: Optional[str] = None
    """``hf``: the hub dataset name (``org/name``); it must be in the local HF cache (never downloaded here)."""
    subset: Optional[str] = None
    """``hf``: the dataset's configuration name (``load_dataset(name, subset)``), if it has several."""
    split: str = "train"
    """``hf`` and ``disk`` (a ``DatasetDict``): the split to train on."""
    format: str = "text"
    """``text``: raw documents (``data.text_field``); ``chat``: a list of ``{role, content}`` messages
    (``data.messages_field``), loss on assistant tokens only; ``prompt_completion``: loss on the
    completion only (``data.prompt_field``, ``data.completion_field``)."""
    packing: bool = True
    """``text`` only: join documents with EOS and cut the stream into ``seq_len`` blocks (true), or one
    document per sample, truncated and right-padded with masked labels (false). ``chat`` and
    ``prompt_completion`` records are always one per sample."""
    text_field: str = "text"
    """Field holding the document text (``format=text``); ``.txt`` files always give ``text``."""
    messages_field: str = "messages"
    """Field holding the list of ``{role, content}`` messages (``format=chat``)."""
    prompt_field: str = "prompt"
    """Field holding the prompt (``format=prompt_completion``); its tokens carry no loss."""
    completion_field: str = "completion"
    """Field holding the completion (``format=prompt_completion``); followed by EOS, carries the loss."""
    chat_template: Optional[str] = None
    """A Jinja chat template (a file path or the template itself) replacing the tokenizer's; it must
    mark assistant text with ``{% generation %}`` ... ``{% endgeneration %}``. ``null``: the tokenizer's
    own, or for the embedded tokenizer the one in ``hybridtrain/data/tokenizer.py``."""
    sample_by: str = "document"
    """``.txt`` files: one record per ``document`` (file), ``paragraph`` (blank-line separated) or ``line``."""
    val_fraction: float = 0.0
    """Hold out this fraction of the records (split by ``trainer.seed``, before packing) for validation; 0: none."""
    val_path: Optional[str] = None
    """A separate validation source of the same kind as ``data.path`` (``files`` or ``disk``)."""
    val_split: Optional[str] = None
    """A split of the same dataset used for validation (``hf``, or ``disk`` with a ``DatasetDict``)."""
    num_proc: int = 1
    """Processes for tokenization (HF ``datasets.map(num_proc=...)``), in the launching process only."""
    seq_len: int = 128
    """Tokens per sample (inputs and shifted labels each ``seq_len`` long)."""
    tokenizer: Optional[str] = None
    """A ``tokenizer.json`` file, or a folder holding an HF tokenizer (``tokenizer_config.json`` and
    ``tokenizer.json``, e.g. a pretrained model folder); ``null``: the embedded BPE tokenizer."""
    cache_dir: Optional[str] = None
    """Where tokenized data is cached; ``null``: ``$HYBRIDTRAIN_CACHE`` or ``~/.cache/hybridtrain``."""


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = 6e-4
    """Peak learning rate, reached at the end of warmup."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices and embeddings only (not to biases or norms)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (across all shards) to this value; 0 disables clipping."""
    warmup_steps: int = 10
    """Linear warmup: optimizer step ``s < warmup_steps`` uses ``lr * (s + 1) / warmup_steps``."""
    min_lr_ratio: float = 0.1
    """The cosine decays to ``lr * min_lr_ratio`` at ``trainer.max_steps``."""


@dataclass
class TrainerConfig:
    """The training loop."""

    max_steps: int = 100
    """Optimizer steps to run (replaced by the value derived from ``trainer.epochs`` when that is set)."""
    epochs: Optional[float] = None
    """Passes over the training samples; when set, ``max_steps = floor(epochs x train samples /
    global_batch_size)`` is derived by the launcher after tokenization. ``null``: use ``max_steps``."""
    eval_every: int = 0
    """Compute the validation loss every this many steps (and always after the last step); 0: only at
    the end. Needs a validation split (``data.val_fraction``, ``data.val_path`` or ``data.val_split``)."""
    global_batch_size: int = 8
    """Samples per optimizer step = micro_batch_size x gradient accumulation x dp."""
    seed: int = 1234
    """Seeds weights, data order and dropout; the same seed gives the same weights under any plan."""
    log_every: int = 1
    """Write a metrics line every this many steps."""
    precision: str = "fp32"
    """``fp32``, ``bf16`` or ``fp16`` (fp16 needs a GPU or a CPU with fp16 kernels)."""
    save_every: int = 0
    """Save a checkpoint every this many steps (0: only the final save)."""
    keep_last: Optional[int] = None
    """Keep only the newest this many checkpoints; ``null`` keeps all."""
    save_final: bool = True
    """Save a checkpoint after the last step."""
    resume: Optional[str] = None
    """Resume everything (weights, optimizer, schedule, step, data position, RNG): ``auto`` takes
    the newest complete checkpoint of the run directory (or starts fresh if there is none), or a
    ``.../checkpoints/step_N`` path. Not together with ``model.pretrained`` (weights only)."""
    export_hf: bool = False
    """After the final save, export the model in HF format to ``RUN_DIR/hf``."""
    hang_timeout_s: Optional[float] = None
    """Hang watchdog: a rank that finishes no training step (with its evaluation and checkpoint save,
    if due) for this many seconds prints the Python stack of every thread and exits non-zero
    (code 3), which ends the job
    (``hybridtrain/train/watchdog.py``, ``docs/faults.md``). ``null``: off; waits inside
    collectives are still bounded by ``launcher.timeout_minutes``. Set it well above the
    slowest step, e.g. 10x the ``step_time_s`` of ``metrics.jsonl``."""


@dataclass
class LauncherConfig:
    """How worker processes are started."""

    name: str = "local"
    """``local``: the deepspeed runner on this machine."""
    nodes: int = 1
    """Machines the job spans; the local launcher runs on one."""
    gpus_per_node: Optional[int] = None
    """Devices per node: GPUs, or CPU processes on machines without GPUs. ``null``: the number
    of CUDA GPUs here, or on a machine without GPUs no limit."""
    master_port: Optional[int] = None
    """Rendezvous port; ``null`` picks a free one."""
    threads_per_rank: Optional[int] = None
    """CPU threads per worker; ``null``: the machine's cores divided by the local ranks."""
    timeout_minutes: int = 10
    """Collective timeout: a rank that stops answering ends the job after this long."""
    dry_run: bool = False
    """Validate the plan, print the derived numbers and write ``config.yaml`` and ``plan.json``
    without preparing data or starting workers (also for cluster recipes on a laptop)."""


@dataclass
class Config:
    """A whole run: what Hydra composes and what is saved as ``config.yaml``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    run_dir: Optional[str] = None
    """Output folder; filled from ``hydra.run.dir`` at launch."""
