"""Typed schema of a hybridtrain run.

Hydra merges the YAML groups in ``conf/`` (and a ``+recipe=`` overlay) into these
dataclasses, so an unknown key or a wrong type is rejected before anything runs.
Library code receives the narrow sub-config it needs, never the whole tree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hybridtrain.config.choices import (
    AttnImplementation,
    FamilyMode,
    DataFormat,
    GpuType,
    DataSource,
    FinetuneMethod, Objective,
    LauncherName,
    LoggerName,
    Partition,
    Precision,
    SampleBy,
)


@dataclass
class ModelConfig:
    """Which HuggingFace causal LM to build."""

    model_type: Optional[str] = "gpt2"
    """HF ``model_type`` of the architecture, one of the families of ``docs/families.md`` (``gpt2``, ``llama``,
    ``mistral``, ``qwen2``, ``qwen3``, ``gemma``, ``gemma2``, ``phi3``, ``olmo2``, ``gpt_neox``); ``null``: the
    ``model.pretrained`` folder's (its ``config.json``)."""
    config: Dict[str, Any] = field(default_factory=dict)
    """Overrides of the HF config under their HF names (``n_layer``, ``num_key_value_heads``...).
    ``vocab_size`` defaults to the tokenizer's vocabulary."""
    family: Optional[FamilyMode] = None
    """``null``: the verified family of ``model.model_type`` (``docs/families.md``); a model type without one
    is refused. ``auto``: derive the adapter from transformers' ``base_model_tp_plan``/``base_model_pp_plan``
    and check it first, in seconds, on a tiny random twin of this config (hybridtrain's logits at tp = 1
    and tp = 2 against transformers' forward); a difference refuses the model with the measured number."""
    attn_implementation: Optional[AttnImplementation] = None
    """HF attention kernel: ``sdpa`` or ``eager``; ``null``: the family's first supported one (sdpa, or eager
    for Gemma 2, whose attention soft-capping transformers runs only there)."""
    pretrained: Optional[str] = None
    """A local HF model folder (``save_pretrained``: config.json + safetensors) to fine-tune:
    weights only, fresh optimizer, step 0. Its config is the model (``model.config`` overrides
    non-shape keys such as dropout); its tokenizer is used unless ``data.tokenizer`` is set."""
    trust_remote_code: bool = False
    """Allow a ``model.pretrained`` folder's custom code. Off: only built-in HF architectures load."""
    vocab_pad_multiple: Optional[int] = None
    """The embedding and LM head are padded to a multiple of ``vocab_pad_multiple * parallel.tp``
    rows; the padded logits are masked, so padding never changes the loss. ``null``: 64 when the
    ranks run on GPUs (tensor-core friendly matmul shapes), 1 on CPU processes."""


@dataclass
class ParallelConfig:
    """How the model and the batch are split over processes (world = dp x cp x tp x pp)."""

    dp: Optional[int] = None
    """Data-parallel replicas. ``null``: whatever the launcher's devices leave after tp x pp
    (on machines without GPUs: one replica per node)."""
    tp: int = 1
    """Tensor-parallel degree: attention heads, MLP width and vocabulary are split Megatron-style."""
    pp: int = 1
    """Pipeline stages (DeepSpeed PipelineModule, 1F1B schedule). ``pp>1`` with one
    micro-batch per step is naive model parallelism."""
    cp: int = 1
    """Context-parallel degree (``docs/long-context.md``): each row's ``data.seq_len`` tokens split over ``cp``
    ranks in ``2 x cp`` chunks (rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, so causal work is balanced);
    keys and values are all-gathered within the group, the loss and the logits stay in pieces. The ranks of a
    cp group hold the same weights (ZeRO and the gradient reduction run over dp x cp). 1: whole rows."""
    ep: int = 1
    """Expert-parallel degree of a mixture-of-experts model (``docs/moe.md``): its routed experts split
    over ``ep`` ranks carved from the data-parallel ones. 1: every rank holds every expert (split over tp)."""
    micro_batch_size: int = 1
    """Samples per micro-batch on each data-parallel replica."""
    zero_stage: Optional[int] = None
    """DeepSpeed ZeRO stage over the data-parallel replicas: 0-3 with pp=1, 0-1 with pp>1.
    ``null``: 0 in fp32 with dp = 1 (one replica has nothing to partition), else 1."""
    partition: Partition = Partition.balanced
    """Pipeline stage boundaries: ``balanced`` (minimise the slowest stage's estimated forward +
    backward time from per-layer FLOPs, within ``plan.device_memory_gb``), ``blocks`` (decoder
    blocks spread evenly, embedding on the first stage, norm and head on the last), ``uniform``
    (every pipeline layer counts 1) or ``parameters`` (balance parameter counts). Ignored with
    ``parallel.stage_layers``."""
    stage_layers: Optional[List[int]] = None
    """Manual stage boundaries: pipeline layers per stage (``pp`` numbers summing to the model's
    pipeline layers: embedding, [positions], blocks, final norm, head), e.g. ``[5, 4]``;
    ``python -m hybridtrain.plan`` lists the layers. ``null``: use ``parallel.partition``."""
    auto: bool = False
    """Choose dp, tp, pp, micro-batch size, ZeRO stage and activation checkpointing by the cost
    model (``parallel=auto``) for ``plan.world_size`` ranks; the keys above are then ignored."""
    activation_checkpointing: Optional[bool] = False
    """Recompute each decoder block's activations in the backward pass instead of storing them (about a
    third more compute). ``null``: the plan decides, on only where a rank's memory would not fit its budget
    with the activations kept (a plan line says which and why; docs/planning.md)."""


@dataclass
class DataConfig:
    """Where training text comes from, how it is tokenized and how it is cut into samples.

    See ``docs/data.md``. Tokenization runs once in the launching process and is cached.
    """

    source: DataSource = DataSource.embedded
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
    format: DataFormat = DataFormat.text
    """``text``: raw documents (``data.text_field``); ``chat``: a list of ``{role, content}`` messages
    (``data.messages_field``), loss on assistant tokens only; ``prompt_completion``: loss on the
    completion only (``data.prompt_field``, ``data.completion_field``)."""
    packing: Optional[str] = None
    """How records become rows of ``seq_len`` tokens (docs/data.md, "Packing"): ``documents`` (whole
    records packed into rows; positions restart and a token attends only to its own record),
    ``stream`` (``text`` only: documents joined by EOS and cut into blocks; attention crosses them) or
    ``none`` (one record per row, right-padded). ``null``: ``stream`` for ``text``, ``documents`` for
    ``chat`` and ``prompt_completion``. The old ``true`` / ``false`` mean ``null`` / ``none``. Resolved
    to a :class:`~hybridtrain.config.choices.Packing` when the config is converted."""
    text_field: str = "text"
    """Field holding the document text (``format=text``); ``.txt`` files always give ``text``."""
    messages_field: str = "messages"
    """Field holding the list of ``{role, content}`` messages (``format=chat``)."""
    prompt_field: str = "prompt"
    """Field holding the prompt (``format=prompt_completion``); its tokens carry no loss."""
    completion_field: str = "completion"
    """Field holding the completion (``format=prompt_completion``); followed by EOS, carries the loss."""
    chosen_field: str = "chosen"
    """Field holding the preferred completion (``format=preference``; ``data.prompt_field`` is its prompt)."""
    rejected_field: str = "rejected"
    """Field holding the dispreferred completion (``format=preference``)."""
    chat_template: Optional[str] = None
    """A Jinja chat template (a file path or the template itself) replacing the tokenizer's; it must
    mark assistant text with ``{% generation %}`` ... ``{% endgeneration %}``. ``null``: the tokenizer's
    own, or for the embedded tokenizer the one in ``hybridtrain/data/tokenizer.py``."""
    skip_invalid: bool = False
    """Records whose field is missing, null or not of the format's type (text for ``text`` and
    ``prompt_completion``, a list of ``{role, content}`` messages with an assistant turn for ``chat``):
    ``false`` stops the run before it starts, naming the files and record numbers; ``true`` leaves them
    out, counted on the console and in the run's ``data.json`` (``skipped``)."""
    sample_by: SampleBy = SampleBy.document
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
    """Where tokenized data is cached; ``null``: ``$HYBRIDTRAIN_CACHE`` or ``~/.cache/hybridtrain``. Moves
    the tokenized data only; every other cache stays under ``$HYBRIDTRAIN_CACHE`` (:mod:`hybridtrain.cache`)."""


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
    fused: bool = True
    """torch's fused AdamW kernel (``torch.optim.AdamW(fused=True)``, the HF Trainer's default
    ``adamw_torch_fused``): one pass over each tensor. ``false``: torch's default implementation, on a
    CPU a loop of elementwise kernels per parameter, several passes over memory where the fused kernel
    makes one (``docs/benchmarks.md``); the two agree to float32 rounding."""


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
    loss_chunk_tokens: int = 4096
    """The LM head and the loss run over pieces of this many tokens when a rank's micro-batch holds more
    (micro-batch x ``data.seq_len`` / cp): each piece's logits ``[tokens, vocab / tp]`` are made, turned into
    its summed loss and dropped, and made again in the backward, so a rank never holds a whole micro-batch's
    logits (``docs/long-context.md``). The same loss and gradients; fewer tokens than this: one piece, as before."""
    seed: int = 1234
    """Seeds weights, data order and dropout; the same seed gives the same weights under any plan."""
    log_every: int = 1
    """Write a metrics line every this many steps."""
    precision: Optional[Precision] = None
    """``fp32``, ``bf16`` or ``fp16`` (fp16 needs a GPU or a CPU with fp16 kernels; bf16 an Ampere or newer
    GPU, or a CPU). ``null``: ``bf16`` when the ranks run on GPUs that support it (``launcher.gpus``, or this
    machine's CUDA devices with ``launcher=local``, or ``launcher.gpu_type`` on a cluster), else ``fp32``;
    the resolved value is written to ``config.yaml``."""
    tf32: bool = True
    """On GPUs, an fp32 run lets its matmuls use TF32 tensor cores (bf16 and fp16 runs keep their fp32 parts
    in full fp32) (``torch.set_float32_matmul_precision("high")``:
    10-bit mantissa products, fp32 accumulation; several times the plain fp32 rate); MFU is then
    measured against the GPU's TF32 peak. False: full fp32 matmuls. No effect on CPU."""
    save_every: int = 0
    """Save a checkpoint every this many steps (0: only the final save)."""
    keep_last: Optional[int] = None
    """Keep only the newest this many checkpoints; ``null`` keeps all."""
    save_final: bool = True
    """Save a checkpoint after the last step."""
    resume: Optional[str] = None
    """Resume everything (weights, optimizer, schedule, step, data position, RNG): ``auto`` takes
    the newest complete checkpoint of the run directory (or starts fresh if there is none), or a
    ``.../checkpoints/step_N`` path. With ``model.pretrained`` too, the checkpoint wins (a resumed fine-tune)."""
    export_hf: bool = False
    """After the final save, export the model in HF format to ``RUN_DIR/hf`` (a LoRA run: its peft
    adapter folder)."""
    save_logits: bool = False
    """Also store in every checkpoint the fp32 logits of the next step's first micro-batch
    (``logits.safetensors``), so ``python -m hybridtrain.export CKPT OUT --check`` can compare the
    exported model's logits with hybridtrain's element by element."""
    profile_steps: List[int] = field(default_factory=list)
    """Steps (1-based, as in ``metrics.jsonl``) whose every forward, backward, send/receive and
    optimizer span is recorded on every rank: the run writes ``timeline.png``, the Chrome trace
    ``timeline_trace.json`` and the measured pipeline bubble (``docs/observability.md``). ``[]``: none."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s of one device for MFU. ``null``: NVIDIA's dense figure for a known GPU and
    ``trainer.precision``, or on a CPU a matmul probe measured once and cached."""
    report: bool = True
    """Write ``report.md`` with plots and findings into the run directory at the end of training."""
    hang_timeout_s: Optional[float] = None
    """Hang watchdog: a rank that finishes no training step (with its evaluation and checkpoint save,
    if due) for this many seconds prints the Python stack of every thread and exits non-zero
    (code 3), which ends the job
    (``hybridtrain/train/watchdog.py``, ``docs/faults.md``). ``null``: off; waits inside
    collectives are still bounded by ``launcher.timeout_minutes``. Set it well above the
    slowest step, e.g. 10x the ``step_time_s`` of ``metrics.jsonl``."""


@dataclass
class LauncherConfig:
    """How worker processes are started: the keys of every launcher. ``launcher=local`` (the default)
    is this class; ``launcher=slurm`` and ``launcher=multinode`` add their own keys
    (:class:`SlurmLauncherConfig`, :class:`MultinodeLauncherConfig`; ``docs/slurm.md``)."""

    name: LauncherName = LauncherName.local
    """``local``: the ranks on this machine, started and watched by the controller; ``slurm``: an ``sbatch`` job whose ``srun``
    starts every rank; ``multinode``: the deepspeed runner over several machines (``launcher.hostfile``,
    or ``launcher.no_ssh`` on each node). Set by the group (``launcher=slurm``), not on its own."""
    nodes: int = 1
    """Machines the job spans; the local launcher runs on one."""
    gpus_per_node: Optional[int] = None
    """Devices per node: GPUs, or CPU processes on machines without GPUs. ``null``: the number
    of CUDA GPUs here, or on a machine without GPUs no limit (``slurm``/``multinode``: the ranks
    spread evenly over ``launcher.nodes``)."""
    master_port: Optional[int] = None
    """Rendezvous port; ``null`` picks a free one (``slurm``: 20000 + job id modulo 20000;
    ``multinode``: DeepSpeed's 29500)."""
    threads_per_rank: Optional[int] = None
    """CPU threads per worker; ``null``: the node's cores divided by the local ranks (``slurm``: the
    job's CPUs on the node, ``SLURM_CPUS_ON_NODE``, divided by the tasks per node). ``slurm``: a value
    also asks for that many CPUs per task (``--cpus-per-task``)."""
    timeout_minutes: int = 10
    """Collective timeout: a rank that stops answering ends the job after this long. It holds for every
    process group (the world, DeepSpeed's pipe / data / model groups, hybridtrain's own), not only the world."""
    keep_host_memory: bool = True
    """CPU ranks keep the host memory their tensors free and reuse it (glibc ``mallopt``: blocks under
    1 GiB come from the heap, which is not trimmed), instead of returning each large block to the OS and
    faulting it in again the next micro-batch: faster (``docs/benchmarks.md``), same numbers; the
    rank's resident memory stays near its peak (``hybridtrain/host_memory.py``). GPU ranks, and C libraries
    other than glibc (no ``mallopt``): no effect."""
    dry_run: bool = False
    """Validate the plan, print the derived numbers and write ``config.yaml`` and ``plan.json``
    without preparing data or starting workers (also for cluster recipes on a laptop)."""
    verbose: bool = False
    """Show DeepSpeed's own output on the console: its INFO and WARNING lines (accelerator detection;
    with ``multinode`` also the runner's commands and world info) and its start-up prints. Off: they go to
    ``RUN_DIR/launcher.log`` and the console shows hybridtrain's lines, the progress bar, everything
    the workers write to stderr (tracebacks, warnings) and DeepSpeed's errors (``local`` and
    ``multinode``; a SLURM job's output is its log file either way)."""
    gpus: Optional[bool] = None
    """Whether the ranks run on GPUs. ``true``: they must (GPU recipes set it): on a machine where
    torch sees no CUDA device the job stops before launching (exit code 2) instead of training on
    CPU cores; ``slurm`` asks for ``launcher.gpus_per_node`` GPUs per node (``--gpus-per-node``) and
    each rank checks on its node. ``false``: none asked for (``slurm`` requests none; CPU processes
    where torch sees no GPU; to use CPU processes on a GPU machine hide its GPUs with
    ``CUDA_VISIBLE_DEVICES=``). ``null``: GPUs when torch sees any; an error when the NVIDIA driver
    lists GPUs here that torch cannot see (a CPU build of torch) unless ``CUDA_VISIBLE_DEVICES``
    hides them; ``slurm``: GPUs when ``launcher.gpu_type`` is set or ``sinfo`` reports GRES ``gpu`` in the
    partition (the plan, made without ``sinfo``, counts only ``launcher.gpu_type``)."""


@dataclass
class ClusterLauncherConfig(LauncherConfig):
    """The keys of the launchers whose ranks run on other machines (``slurm``, ``multinode``): the plan
    takes the nodes' device facts from here, never from the machine the command runs on."""

    gpu_type: Optional[GpuType] = None
    """The GPU model of the nodes: ``a100-40gb``, ``a100-80gb``, ``h100-80gb``, ``h100-pcie``, ``h100-nvl``,
    ``h200``, ``h200-nvl``, ``gh200``, ``b200``, ``gb200``, ``l40s``, ``l40``, ``l4``, ``a10``, ``v100-16gb``,
    ``v100-32gb``. Gives the plan the device memory, bf16 support, the peak FLOP/s and the NVLink/PCIe
    rates of ``parallel=auto`` (``docs/gpu.md``), and means the ranks run on GPUs unless ``launcher.gpus=false``.
    ``null``: unknown GPUs (no memory limit unless ``plan.device_memory_gb``; ``parallel=auto`` on GPUs
    then needs ``plan.device_memory_gb``)."""


@dataclass
class SlurmLauncherConfig(ClusterLauncherConfig):
    """``launcher=slurm``: an ``sbatch`` job on a SLURM cluster; its ``srun`` starts every rank."""

    name: LauncherName = LauncherName.slurm
    """Always ``slurm`` (the class is chosen by ``launcher=slurm``)."""
    cpus_per_task: Optional[int] = None
    """CPU cores reserved for each rank (``--cpus-per-task``). ``null``: ``launcher.threads_per_rank`` when
    set, else 8 on GPU jobs (GPU nodes have 8 or more cores per GPU), else none requested. A
    ``--cpus-per-*`` option in ``launcher.sbatch`` replaces it."""
    mem_per_gpu: Optional[str] = None
    """Host memory for each GPU (``--mem-per-gpu``, a SLURM size such as ``64G`` or ``512000M``) on GPU jobs.
    ``null``: ``64G`` (each rank's CPU side: data, the unit being initialised, pinned buffers). A
    ``--mem*`` option in ``launcher.sbatch`` (e.g. ``--mem=0``: all of the node's) replaces it."""
    partition: Optional[str] = None
    """The partition (``--partition``); ``null``: the cluster's default."""
    account: Optional[str] = None
    """The account charged (``--account``); ``null``: your default account."""
    qos: Optional[str] = None
    """The quality of service (``--qos``); ``null``: the default."""
    time: Optional[str] = None
    """The time limit (``--time``, e.g. ``02:00:00`` or ``1-00:00:00``); ``null``: the
    partition's default."""
    constraint: Optional[str] = None
    """Node features the job needs (``--constraint``, e.g. ``a100``); ``null``: any node."""
    sbatch: List[str] = field(default_factory=list)
    """Extra ``#SBATCH`` options, one per entry (``--exclusive``, ``--mem=0``, ``--mail-type=END``);
    the ``#SBATCH`` prefix is optional."""
    setup: List[str] = field(default_factory=list)
    """Shell lines the job runs before starting the ranks (``module load cuda/12.4``,
    ``source ~/venv/bin/activate``); with them set ``launcher.python=python`` to use the activated one."""
    python: Optional[str] = None
    """The Python the job runs; ``null``: the interpreter running this command."""
    signal_seconds: int = 120
    """Seconds before the time limit at which SLURM warns the ranks (``--signal=USR1@N``); they
    save a checkpoint and the job requeues itself. 0: no warning."""
    requeue: bool = True
    """On the warning signal or SIGTERM, checkpoint and requeue the job (``scontrol requeue``);
    the requeued job resumes from that checkpoint. Off: checkpoint and end the job."""
    submit: bool = True
    """Submit the job with ``sbatch``; off: only write ``RUN_DIR/job.sbatch`` and print it (the
    data is then prepared when the job starts)."""
    wait: bool = False
    """Wait for the job to end (``sbatch --wait``) and exit with its status."""


@dataclass
class MultinodeLauncherConfig(ClusterLauncherConfig):
    """``launcher=multinode``: the deepspeed runner over several machines, without SLURM."""

    name: LauncherName = LauncherName.multinode
    """Always ``multinode`` (the class is chosen by ``launcher=multinode``)."""
    hostfile: Optional[str] = None
    """A DeepSpeed hostfile (``host slots=N`` per line); the runner reaches the hosts over
    ssh (pdsh). With ``launcher.no_ssh``: optional, it only names the nodes."""
    no_ssh: bool = False
    """Start only this node's ranks (the runner's ``--no_ssh``); run the same command on
    every node with its ``launcher.node_rank`` and the same ``launcher.master_addr``."""
    node_rank: Optional[int] = None
    """With ``no_ssh``: this node's index, 0 .. ``launcher.nodes - 1`` (rank 0's node is 0)."""
    master_addr: Optional[str] = None
    """The address of node 0, where rank 0 listens (needed with ``no_ssh``; else the
    runner asks the first host of the hostfile)."""


LAUNCHER_CONFIGS = {LauncherName.local: LauncherConfig, LauncherName.slurm: SlurmLauncherConfig,
                    LauncherName.multinode: MultinodeLauncherConfig}
"""The schema of each ``launcher`` group option, by ``launcher.name``."""


@dataclass
class LoggerConfig:
    """Where rank 0 sends the metrics besides ``metrics.jsonl`` (``logger=none|tensorboard|wandb``)."""

    name: LoggerName = LoggerName.none
    """``none``, ``tensorboard`` (event files) or ``wandb`` (Weights & Biases, offline mode only)."""
    dir: Optional[str] = None
    """Output folder; ``null``: ``RUN_DIR/tensorboard`` for TensorBoard, ``RUN_DIR`` for W&B (which
    writes ``wandb/offline-run-*`` there; upload later with ``wandb sync``)."""
    project: str = "hybridtrain"
    """W&B project name recorded in the offline run."""
    run_name: Optional[str] = None
    """Run name shown by the logger; ``null``: the run directory's name."""


@dataclass
class PlanConfig:
    """Planning options: what ``python -m hybridtrain.plan`` and ``parallel=auto`` plan for."""

    device_memory_gb: Optional[float] = None
    """Memory of one device in GiB; the plan warns above its budget (less ``plan.memory_headroom`` and
    ``plan.memory_reserved_gb`` on GPUs), the balanced partition and ``parallel=auto`` keep under it.
    ``null``: the GPU's memory (``launcher=slurm``/``multinode``: ``launcher.gpu_type``'s), or for CPU
    processes of ``launcher=local`` the machine's RAM divided by the ranks of a node (a cluster's CPU
    nodes: unknown, no limit)."""
    world_size: Optional[int] = None
    """Ranks to plan for with ``parallel=auto``. ``null``: ``launcher.nodes x launcher.gpus_per_node``
    (on a machine without GPUs and no ``gpus_per_node``: 1)."""
    memory_headroom: float = 0.1
    """Share of a GPU's memory the plan keeps free for the CUDA context, NCCL buffers and allocator
    fragmentation: a rank's budget is ``(1 - memory_headroom) x device memory - memory_reserved_gb``
    (plan warnings, the balanced partition's memory limit, ``parallel=auto``). CPU processes use the
    whole figure."""
    memory_reserved_gb: float = 2.0
    """GiB of a GPU's memory kept free besides ``memory_headroom`` (the CUDA context and kernels, NCCL
    communicators); GPUs only."""
    calibrate: bool = True
    """Calibrate the cost model on this machine (a matmul and an all-reduce probe, cached under
    ``$HYBRIDTRAIN_CACHE`` or ``~/.cache/hybridtrain``); false: the built-in defaults."""
    top: int = 5
    """Runners-up ``parallel=auto`` prints after the chosen plan."""


@dataclass
class LoraConfig:
    """LoRA adapters on the decoder blocks' linear layers (``finetune.method=lora``), as ``peft`` defines
    them: ``y = W x + (alpha / r) B A dropout(x)`` with ``A`` ``[r, in]`` and ``B`` ``[out, r]``
    (``docs/finetuning.md``)."""

    r: int = 8
    """Rank of the adapters (peft's ``r``)."""
    alpha: float = 16.0
    """Scale numerator (peft's ``lora_alpha``): the adapter's output is multiplied by ``alpha / r``
    (``alpha / sqrt(r)`` with ``rslora``)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (peft's ``lora_dropout``), in [0, 1)."""
    target_modules: Any = "all-linear"
    """Which linear layers get adapters, with peft's matching: ``all-linear`` (every linear layer of the
    decoder blocks; the LM head never), a list of module names matched as peft does (a module whose
    path equals or ends with ``.NAME``: ``[q_proj,v_proj]``, ``[self_attn.o_proj]``), or one regular
    expression that must match a whole module path (``.*\\.(q|v)_proj``)."""
    rslora: bool = False
    """Rank-stabilised scaling ``alpha / sqrt(r)`` instead of ``alpha / r`` (peft's ``use_rslora``)."""
    init_from: Optional[str] = None
    """A peft adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) to start from
    instead of fresh adapters; its ``r``, ``alpha``, ``rslora`` and target modules replace the keys
    above (``dropout`` stays). Its base must be ``model.pretrained``'s model."""


@dataclass
class DPOConfig:
    """The preference loss of ``finetune.objective=dpo``, with TRL's ``DPOConfig`` names and meanings
    (``docs/preference.md``)."""

    beta: float = 0.1
    """Strength of the implicit KL term (TRL's ``beta``): rewards are ``beta x (log pi - log pi_ref)``;
    for ``ipo`` the regularisation ``tau``."""
    loss_type: List[str] = field(default_factory=lambda: ["sigmoid"])
    """TRL's loss names, one or several summed with ``loss_weights``: ``sigmoid`` (DPO), ``ipo``, ``hinge``,
    ``robust``, ``sigmoid_norm`` (DPO on per-token mean log-ratios), ``apo_zero``, ``apo_down``, ``nca_pair``,
    ``bco_pair``, ``sppo_hard``, ``exo_pair``, ``discopop``, ``sft`` (the chosen completions' token NLL)."""
    loss_weights: Optional[List[float]] = None
    """One weight per ``loss_type`` entry; ``null``: 1 each."""
    label_smoothing: float = 0.0
    """The assumed share of flipped labels (``robust``, ``exo_pair``; TRL's ``label_smoothing``), in [0, 0.5)."""
    discopop_tau: float = 0.05
    """``discopop``'s temperature (TRL's ``discopop_tau``)."""


@dataclass
class RewardConfig:
    """The reward model of ``finetune.objective=reward``, with TRL's ``RewardConfig`` names and meanings
    (``docs/preference.md#reward-models``)."""

    center_rewards_coefficient: Optional[float] = None
    """Adds ``coefficient x mean((r_chosen + r_rejected)^2)`` over the batch's pairs to the loss, pulling the
    rewards towards mean zero (TRL's ``center_rewards_coefficient``); ``null``: no such term."""


@dataclass
class CPOConfig:
    """The reference-free loss of ``finetune.objective=cpo``, with TRL's ``CPOConfig`` names and meanings
    (``docs/preference.md``); SimPO is ``loss_type=simpo`` with ``cpo_alpha=0``."""

    beta: float = 0.1
    """The temperature of the log-probability margin (TRL's ``beta``): rewards are ``beta x log pi`` (for
    ``ipo`` and ``simpo`` the per-token mean log-probability); for ``ipo`` the regularisation ``tau``."""
    loss_type: str = "sigmoid"
    """TRL's CPO loss name: ``sigmoid`` (CPO), ``hinge``, ``ipo``, ``simpo`` (length-normalised, with the
    target margin ``simpo_gamma``)."""
    label_smoothing: float = 0.0
    """The assumed share of flipped labels (``sigmoid``, ``simpo``; TRL's ``label_smoothing``), in [0, 0.5)."""
    cpo_alpha: float = 1.0
    """Weight of the chosen completions' token NLL added to the loss (TRL's ``cpo_alpha``; 0 for SimPO)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (TRL's ``simpo_gamma``; ``loss_type=simpo`` only)."""
    alpha: float = 0.0
    """AlphaPO's reward shape (TRL's ``alpha``): 0 uses the log-probabilities, else ``(1 - p^-alpha) / alpha``."""


@dataclass
class ORPOConfig:
    """The reference-free loss of ``finetune.objective=orpo``, with TRL's ``ORPOConfig`` names and meanings
    (``docs/preference.md``)."""

    beta: float = 0.1
    """Weight of the odds-ratio term added to the chosen sequences' NLL (TRL's ``beta``, the paper's lambda);
    rewards are ``beta x`` the per-token mean log-probability."""


@dataclass
class FinetuneConfig:
    """Which parameters train: all of them, or LoRA adapters on a frozen base (``docs/finetuning.md``)."""

    method: FinetuneMethod = FinetuneMethod.full
    """``full``: every parameter trains; ``lora``: the base model is frozen (no gradients, no optimizer
    state) and only the adapters of ``finetune.lora`` train."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    objective: Objective = Objective.sft
    """``sft``: the token cross-entropy; ``dpo``: a preference loss of ``finetune.dpo`` over
    ``data.format=preference`` pairs; ``cpo`` / ``orpo``: the reference-free ones of ``finetune.cpo`` /
    ``finetune.orpo`` (``docs/preference.md``); ``reward``: a reward model (a scalar head on each sequence's
    last token) over the same pairs, ``finetune.reward``."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    cpo: CPOConfig = field(default_factory=CPOConfig)
    """The loss of ``finetune.objective=cpo`` (no reference model)."""
    orpo: ORPOConfig = field(default_factory=ORPOConfig)
    """The loss of ``finetune.objective=orpo`` (no reference model)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward model's options (``finetune.objective=reward``)."""


@dataclass
class Config:
    """A whole run: what Hydra composes and what is saved as ``config.yaml``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    run_dir: Optional[str] = None
    """Output folder; filled from ``hydra.run.dir`` at launch."""
