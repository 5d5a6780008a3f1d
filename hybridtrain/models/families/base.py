"""What a model family is: where the HF modules live, how a decoder block splits over tensor
parallelism, and the model-level operations outside the blocks.

A family module (``gpt2.py``, ``llama.py``, ...) holds one :class:`Family` value and any behaviour of
its own; :mod:`hybridtrain.models.families` registers them in one place. The tensor-parallel plan
is derived from transformers' own ``base_model_tp_plan`` where the config class ships one
(:func:`tp_plan_from_hf`), and a family states only what differs.

Everything here is data and imports neither torch nor deepspeed; what each style does is in
:mod:`hybridtrain.parallel.tensor`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from hybridtrain.parallel.tensor import TPStyle, style_of

Fused = Union[int, tuple[str, ...]]
"""Sub-blocks fused along a column-parallel linear's output: ``n`` equal blocks, or the block sizes by
name (``"q"`` = heads x head_dim, ``"kv"`` = KV heads x head_dim, ``"mlp"``, ``"hidden"``; Gated DeltaNet's
``"linear_k"`` = key heads x key head dim, ``"linear_v"`` = value heads x value head dim)."""

HF_STYLES = {"colwise": "column", "rowwise": "row", "replicated_with_grad_allreduce": "grad_sum"}
"""transformers' ``base_model_tp_plan`` styles that are Megatron-exact as they stand. The gathering
ones (``colwise_gather_output``, ``rowwise_split_input``) replicate activations where Megatron splits
them; a family that has them states its own rule."""


@dataclass(frozen=True)
class TPRule:
    """How one HF submodule inside a decoder block is split over the TP group."""

    style: str
    """The name of a tensor-parallel style (:data:`hybridtrain.parallel.tensor.STYLES`: ``column``, ``row``,
    ``norm``, ``grad_sum``); :attr:`tp_style` is the object that implements it."""
    conv1d: bool = False
    """HF ``Conv1D`` stores its weight as ``[in, out]`` (GPT-2); it is transposed to ``[out, in]``."""
    fused: Fused = 1
    """Sub-blocks fused along the output features (GPT-2 ``c_attn`` = q | k | v: 3; Phi-3 ``qkv_proj`` =
    ``("q", "kv", "kv")``); each is split on its own so every rank gets matching q, k and v heads."""
    replace: Optional[Callable[..., Any]] = field(default=None, compare=False)
    """``style="norm"``: ``replace(module, weight_shard, full_width, tp) -> nn.Module``, the sharded norm."""

    @property
    def tp_style(self) -> TPStyle:
        """The :class:`~hybridtrain.parallel.tensor.TPStyle` named by :attr:`style` (``ValueError`` if none is)."""
        return style_of(self.style)


EXPERTS_RULES: dict[str, Optional[TPRule]] = {
    "mlp.experts": TPRule("experts"),
    "mlp.experts.gate_up_proj": None,
    "mlp.experts.down_proj": None,
}
"""The TP rules of a mixture-of-experts block's fused experts module (``mlp.experts``: the ``experts`` style
slices its 3-D ``gate_up_proj`` / ``down_proj`` itself, so transformers' plan entries for the two weights match
no rule of their own). Shared by every MoE family."""

DENSE_MLP_RULES: dict[str, Optional[TPRule]] = {
    "mlp.experts": None,
    "mlp.gate_proj": TPRule("column"),
    "mlp.up_proj": TPRule("column"),
    "mlp.down_proj": TPRule("row"),
}
"""The rules of an MoE model's dense block (``Family.variant_rules["dense"]``): its MLP is a plain SwiGLU
(``gate_proj`` and ``up_proj`` column-wise, ``down_proj`` row-wise, "f" on ``mlp``) and it has no experts."""

SHARED_EXPERT_RULES: dict[str, Optional[TPRule]] = {
    "mlp.shared_expert.gate_proj": TPRule("column"),
    "mlp.shared_expert.up_proj": TPRule("column"),
    "mlp.shared_expert.down_proj": TPRule("row"),
    "mlp.shared_expert_gate": TPRule("replicated"),  # outside the TP region; named so LoRA can adapt it
}
"""The rules of a gated shared expert (Qwen2-MoE's, Qwen3.5-MoE's, Qwen3-Next's): a SwiGLU MLP split
Megatron-style with its own "f" (``mlp.shared_expert`` in ``input_copy``), and its ``sigmoid`` gate
(``Linear(H, 1)``) replicated beside the router (transformers' plans have no entries for either)."""

NO_SHARED_EXPERT: dict[str, Optional[TPRule]] = {name: None for name in SHARED_EXPERT_RULES}
"""The rules of a block without the shared expert (a dense variant's)."""


@dataclass(frozen=True)
class MoE:
    """Where a mixture-of-experts family's routed experts live and which HF config keys size them
    (``docs/moe.md``). Every path is relative to a decoder block."""

    router: str = "mlp.gate"
    """The router module (transformers' ``*TopKRouter``, whose output 0 is the router logits ``[T, E]``,
    what transformers' ``OutputRecorder`` records for ``load_balancing_loss_func``)."""
    experts: str = "mlp.experts"
    """The experts module (fused 3-D ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)."""
    num_experts: str = "num_experts"
    """HF config key: routed experts per MoE layer."""
    top_k: str = "num_experts_per_tok"
    """HF config key: experts each token is routed to."""
    width: str = "moe_intermediate_size"
    """HF config key: one expert's MLP width (``I``), split over tensor parallelism."""
    shared_width: Optional[str] = None
    """HF config key of the shared expert's MLP width (Qwen2-MoE), split over tensor parallelism; ``None``: none."""
    shared_experts: Optional[str] = None
    """HF config key of the number of shared experts of the routed experts' width, which transformers runs as one
    MLP that many times as wide (DeepSeek-V3's ``n_shared_experts``); ``None``: none, or :attr:`shared_width`."""
    aux_coef: str = "router_aux_loss_coef"
    """HF config key: the coefficient of the load-balancing loss in the training loss."""
    aux_on: str = "output_router_logits"
    """HF config key that switches the load-balancing loss on (transformers adds it to the loss only then)."""
    aux_loss: bool = True
    """Whether transformers' causal-LM loss of this family can include the load-balancing term at all
    (DeepSeek-V3's never does, whatever ``output_router_logits`` says)."""
    dense_layers: Optional[Callable[[Any], Sequence[int]]] = field(default=None, compare=False)
    """HF config -> indices of the blocks with a dense MLP instead of experts (``None``: every block routes).
    Their tensor-parallel rules are the family's ``variant_rules["dense"]`` (``docs/moe.md``)."""

    def dense_blocks(self, hf_config: Any) -> list[int]:
        """The blocks of ``hf_config`` whose MLP is dense (no experts)."""
        return sorted(int(i) for i in self.dense_layers(hf_config)) if self.dense_layers else []

    def shared_width_of(self, hf_config: Any) -> int:
        """The MLP width of the block's shared expert(s) every token runs (0: none)."""
        if self.shared_width:
            return int(getattr(hf_config, self.shared_width))
        if self.shared_experts:
            return int(getattr(hf_config, self.shared_experts) or 0) * int(getattr(hf_config, self.width))
        return 0

    def aux_enabled(self, hf_config: Any) -> bool:
        """Whether the model's loss includes the router's load-balancing term (transformers' rule)."""
        return self.aux_loss and bool(getattr(hf_config, self.aux_on, False))


@dataclass(frozen=True)
class LinearAttention:
    """Where a hybrid model's linear-attention blocks are and what they need (Gated DeltaNet: Qwen3.5,
    Qwen3-Next). Such a block has no softmax attention and no mask: its token mixer is a recurrence over the row
    (a depthwise causal conv1d, then the gated delta rule), so a packed row's documents are kept apart by running
    the mixer per document (:mod:`hybridtrain.models.linear_attention`)."""

    variant: str = "linear_attention"
    """The block variant (transformers' ``layer_types`` entry) of the linear-attention blocks; a variant named
    ``<variant>_<more>`` is one too (Qwen3-Next's ``linear_attention_dense``: a Gated DeltaNet with a dense MLP)."""
    module: str = "linear_attn"
    """Block-relative path of the linear-attention module (in place of :attr:`Family.attention`)."""
    shape_keys: tuple[str, ...] = ("linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
    """HF config keys that size its weights (beside the head counts of :attr:`Family.tp_divides`)."""


@dataclass(frozen=True)
class Family:
    """The adapter of one HF ``model_type``: module paths, the block's TP plan, model-level operations."""

    model_type: str
    embed: str
    """Path of the token embedding in the HF causal-LM model."""
    blocks: str
    """Path of the ``nn.ModuleList`` of decoder blocks."""
    final_norm: str
    head: str
    """Path of the LM head (``lm_head``); tied heads reuse the embedding weight."""
    hf_config_class: Optional[str] = None
    """Name of the transformers config class whose ``base_model_tp_plan`` gives the TP plan (read on
    first use, so importing a family does not import transformers); ``None``: :attr:`tp_rules` only."""
    tp_rules: Mapping[str, Optional[TPRule]] = field(default_factory=dict)
    """Block-relative HF module name -> split rule, over transformers' plan (``None`` drops an entry)."""
    position_embed: Optional[str] = None
    """Learned absolute position embedding (GPT-2 ``wpe``), or ``None`` (rotary models)."""
    rotary_embed: Optional[str] = None
    """Path of the model's rotary-embedding module; each block rebuilds one of its class."""
    attention: str = "self_attn"
    """Block-relative path of the attention module (its ``sliding_window`` picks the layer's mask)."""
    input_copy: tuple[str, ...] = ("self_attn", "mlp")
    """Block submodules whose first input feeds column-parallel linears: the Megatron "f" (identity
    forward, all-reduce backward) is applied once there instead of once per linear."""
    heads_per_rank_attrs: tuple[str, ...] = ()
    """``module.attribute`` paths inside a block holding head counts or widths, divided by tp after
    sharding (GPT-2 ``attn.split_size``)."""
    per_rank_config: tuple[str, ...] = ()
    """HF config keys the attention reads at forward time (Phi-3 reads ``num_attention_heads``): the
    attention gets a shallow copy of the config with these divided by tp."""
    embed_scale: bool = False
    """The embedding lookup (not the tied head) is multiplied by sqrt(hidden) (Gemma)."""
    final_logit_softcap: Optional[str] = None
    """HF config key of the final logit soft-cap ``tanh(logits / c) * c`` (Gemma 2), applied on the
    head's vocabulary shard before the padded columns are masked."""
    embed_dropout: Optional[str] = None
    """HF config key of the dropout applied to the embeddings (GPT-2 ``embd_pdrop``, after the
    position embedding; GPT-NeoX ``hidden_dropout``)."""
    dropout_keys: tuple[str, ...] = ()
    """Every HF dropout key; ``verify``'s twin sets them to 0 (masks depend on the layout)."""
    checkpoint_names: Mapping[str, str] = field(default_factory=dict)
    """HF parameter name -> the name ``save_pretrained`` writes (GPT-NeoX ``lm_head.weight`` ->
    ``embed_out.weight``)."""
    attn_implementations: tuple[str, ...] = ("sdpa", "eager", "flash_attention_2")
    """Attention kernels transformers supports for this family (Gemma 2: eager only); the first is the default."""
    block_variants: Optional[Callable[[Any], Sequence[str]]] = None
    """HF config -> each decoder block's variant (:func:`hybridtrain.models.units.block_variants`), for models
    whose blocks differ beyond transformers' ``layer_types`` (an MoE model's leading dense blocks); ``None``:
    ``layer_types``, else all blocks alike."""
    variant_rules: Mapping[str, Mapping[str, Optional[TPRule]]] = field(default_factory=dict)
    """Block variant (:attr:`block_variants`) -> rules over :attr:`tp_plan` for the blocks of that variant
    (``None`` drops an entry): an MoE model's dense blocks split a plain MLP instead of experts
    (:data:`DENSE_MLP_RULES`). A variant not named here has :attr:`tp_plan` (:meth:`plan_of`)."""
    variant_input_copy: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Block variant -> its :attr:`input_copy` where it differs (a dense block's ``mlp`` gets the "f" an MoE
    block puts on its experts' inputs)."""
    context_parallel: Optional[str] = None
    """Why ``parallel.cp`` > 1 cannot run this family (DeepSeek-V3: MLA's value head is narrower than its
    query/key head, which the context-parallel attention kernels do not take); ``None``: it can."""
    saved_buffers: tuple[str, ...] = ()
    """Block-relative names of persistent buffers a checkpoint holds and a run keeps as they are (DeepSeek-V3's
    ``mlp.gate.e_score_correction_bias``): read from the pretrained weights, written into ``hf/`` and the export.
    A block without one (a dense block) skips it."""
    moe: Optional[MoE] = None
    """Mixture-of-experts families: where the router and the experts are (:class:`MoE`); ``None``: dense."""
    linear_attention: Optional[LinearAttention] = None
    """Hybrid linear-attention families (Qwen3.5, Qwen3-Next): which block variant holds a recurrent token mixer
    instead of softmax attention (:class:`LinearAttention`); ``None``: every block attends."""
    variant_heads_per_rank_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Block variant -> its :attr:`heads_per_rank_attrs` where it differs (a Gated DeltaNet block's ``key_dim``
    and ``value_dim``, which its forward splits the fused q | k | v by)."""
    unverified_lora: Mapping[str, str] = field(default_factory=dict)
    """Block-relative module path -> why LoRA adapters on it (or on modules under it) are refused in this version
    (Qwen3.5's Gated DeltaNet ``linear_attn``: not yet proven against peft)."""
    refused_config: Mapping[str, str] = field(default_factory=dict)
    """HF config key -> why the family cannot train with it set (true or non-empty): the plan refuses such a config
    naming ``model.config.<key>`` (Gemma 3's ``use_bidirectional_attention``, an embedding model's attention)."""
    tp_divides: tuple[str, ...] = ()
    """Further HF config keys tp must divide (:func:`tp_divisible`) and a pretrained model's config may not
    override (:meth:`shape_keys`): Gated DeltaNet's key and value head counts."""
    n_layers: str = "num_hidden_layers"
    hidden: str = "hidden_size"
    heads: str = "num_attention_heads"
    kv_heads: Optional[str] = "num_key_value_heads"
    mlp_width: str = "intermediate_size"
    max_positions: str = "max_position_embeddings"

    @cached_property
    def tp_plan(self) -> dict[str, TPRule]:
        """Block-relative HF module name -> split rule (transformers' plan with :attr:`tp_rules` over it).
        An entry that matches no module is an error when a block is sharded."""
        if self.hf_config_class is None:
            return {k: v for k, v in self.tp_rules.items() if v is not None}
        import transformers

        return tp_plan_from_hf(getattr(transformers, self.hf_config_class), self.tp_rules)

    def plan_of(self, variant: Optional[str] = None) -> dict[str, TPRule]:
        """The tensor-parallel plan of the blocks of ``variant``: :attr:`tp_plan` with the variant's
        :attr:`variant_rules` over it (``None``, or a variant without rules: :attr:`tp_plan` itself)."""
        rules = self.variant_rules.get(variant) if variant else None
        if not rules:
            return self.tp_plan
        plan = dict(self.tp_plan)
        for name, rule in rules.items():
            if rule is None:
                plan.pop(name, None)
            else:
                plan[name] = rule
        return plan

    def input_copy_of(self, variant: Optional[str] = None) -> tuple[str, ...]:
        """The block submodules that get Megatron's "f" in blocks of ``variant`` (:attr:`input_copy` unless
        :attr:`variant_input_copy` names the variant)."""
        return tuple(self.variant_input_copy.get(variant, self.input_copy)) if variant else self.input_copy

    def block_plan(self, hf_config: Any, index: int) -> dict[str, TPRule]:
        """The tensor-parallel plan of decoder block ``index`` of ``hf_config``'s model (its variant's)."""
        return self.plan_of(self.variant_of(hf_config, index))

    def variant_of(self, hf_config: Any, index: int) -> str:
        """The variant of decoder block ``index`` (:func:`hybridtrain.models.units.block_variants`)."""
        from hybridtrain.models.units import block_variants

        return block_variants(self, hf_config)[index]

    def all_rules(self) -> dict[str, TPRule]:
        """Every block-relative module any variant's plan splits, with its rule (LoRA's module names)."""
        out = dict(self.tp_plan)
        for variant in self.variant_rules:
            out.update(self.plan_of(variant))
        return out

    def heads_per_rank_attrs_of(self, variant: Optional[str] = None) -> tuple[str, ...]:
        """The per-rank head attributes of blocks of ``variant`` (:attr:`heads_per_rank_attrs` unless
        :attr:`variant_heads_per_rank_attrs` names the variant)."""
        if variant and variant in self.variant_heads_per_rank_attrs:
            return tuple(self.variant_heads_per_rank_attrs[variant])
        return self.heads_per_rank_attrs

    def is_linear_attention(self, variant: Optional[str]) -> bool:
        """Whether blocks of ``variant`` mix tokens with a recurrent linear attention (:attr:`linear_attention`)."""
        if self.linear_attention is None or not variant:
            return False
        return variant == self.linear_attention.variant or variant.startswith(f"{self.linear_attention.variant}_")

    def checkpoint_name(self, hf_name: str) -> str:
        """The tensor name in a ``save_pretrained`` folder of the parameter called ``hf_name`` in the model."""
        return self.checkpoint_names.get(hf_name, hf_name)

    def shape_keys(self) -> tuple[str, ...]:
        """HF config keys that fix tensor shapes (a pretrained model's may not be overridden)."""
        keys = (self.n_layers, self.hidden, self.heads, self.kv_heads, self.mlp_width, self.max_positions,
                "head_dim", "vocab_size", "tie_word_embeddings")
        if self.moe is not None:
            keys += (self.moe.num_experts, self.moe.width)
        keys += self.tp_divides
        if self.linear_attention is not None:
            keys += self.linear_attention.shape_keys
        return tuple(k for k in keys if k)


def tp_plan_from_hf(config_class: Any, overrides: Mapping[str, Optional[TPRule]]) -> dict[str, TPRule]:
    """The block part of transformers' ``base_model_tp_plan`` of ``config_class`` as :class:`TPRule` s
    (``layers.*.self_attn.q_proj: colwise`` -> ``self_attn.q_proj: column``), with ``overrides`` over it
    (``None`` drops an entry). A style that is not Megatron-exact (:data:`HF_STYLES`) must be
    overridden, else :class:`ValueError`."""
    plan: dict[str, TPRule] = {}
    fixed = dict(overrides)
    for key, style in (getattr(config_class, "base_model_tp_plan", None) or {}).items():
        prefix, star, name = key.partition(".*.")
        if not star:  # model-level entries (GPT-NeoX's embedding): hybridtrain's vocabulary parallelism
            continue
        if name in fixed:
            continue
        if style not in HF_STYLES:
            raise ValueError(f"{config_class.__name__}.base_model_tp_plan[{key!r}] = {style!r} is not a Megatron "
                             f"split; the family must state a rule for {name!r}")
        plan[name] = TPRule(HF_STYLES[style])
    plan.update({k: v for k, v in fixed.items() if v is not None})
    return plan


def head_dim_of(family: Family, hf_config: Any) -> int:
    """Width of one attention head (``head_dim`` when the config has one, else hidden / heads)."""
    explicit = getattr(hf_config, "head_dim", None)
    if explicit:
        return int(explicit)
    return int(getattr(hf_config, family.hidden)) // int(getattr(hf_config, family.heads))


def attention_head_dims(family: Family, hf_config: Any) -> tuple[int, int]:
    """``(query/key width, value width)`` of one attention head: :func:`head_dim_of` for both, except where the
    config gives them apart (multi-head latent attention: DeepSeek-V3's ``qk_head_dim`` = ``qk_nope_head_dim +
    qk_rope_head_dim`` and ``v_head_dim``; its ``head_dim`` is the rotary part only)."""
    qk, v = getattr(hf_config, "qk_head_dim", None), getattr(hf_config, "v_head_dim", None)
    if qk and v:
        return int(qk), int(v)
    hd = head_dim_of(family, hf_config)
    return hd, hd


def kv_heads_of(family: Family, hf_config: Any) -> int:
    """KV heads (the attention heads without grouped-query attention)."""
    kv = getattr(hf_config, family.kv_heads, None) if family.kv_heads else None
    return int(kv) if kv else int(getattr(hf_config, family.heads))


def mlp_width_of(family: Family, hf_config: Any) -> int:
    """MLP hidden width of ``hf_config`` (GPT-2's ``n_inner=None`` means ``4 * n_embd``)."""
    width = getattr(hf_config, family.mlp_width, None)
    return int(width) if width is not None else 4 * int(getattr(hf_config, family.hidden))


def fused_sizes(rule: TPRule, family: Family, hf_config: Any, length: Optional[int] = None) -> int | tuple[int, ...]:
    """The fused sub-blocks of ``rule``: an ``int`` (equal blocks) or the sizes of the named blocks in
    ``hf_config``, checked against the module's ``length`` outputs when given."""
    if isinstance(rule.fused, int):
        return rule.fused
    hd = head_dim_of(family, hf_config)
    named = {"q": int(getattr(hf_config, family.heads)) * hd, "kv": kv_heads_of(family, hf_config) * hd,
             "mlp": mlp_width_of(family, hf_config), "hidden": int(getattr(hf_config, family.hidden))}
    if getattr(hf_config, "linear_num_key_heads", None):  # Gated DeltaNet's q | k | v (its own head counts)
        named["linear_k"] = int(hf_config.linear_num_key_heads) * int(hf_config.linear_key_head_dim)
        named["linear_v"] = int(hf_config.linear_num_value_heads) * int(hf_config.linear_value_head_dim)
    sizes = tuple(named[n] for n in rule.fused)
    if length is not None and sum(sizes) != length:
        raise ValueError(f"fused blocks {rule.fused} = {sizes} do not add up to the module's {length} outputs")
    return sizes


def tp_divisible(family: Family, hf_config: Any) -> dict[str, int]:
    """``config key -> value`` of every size tp must divide (heads, KV heads, MLP width)."""
    out = {family.heads: int(getattr(hf_config, family.heads))}
    if family.moe is not None:  # the experts' width (and a shared expert's); the dense MLP's only where a block has one
        out[family.moe.width] = int(getattr(hf_config, family.moe.width))
        if family.moe.shared_width:
            out[family.moe.shared_width] = int(getattr(hf_config, family.moe.shared_width))
    if family.moe is None or family.moe.dense_blocks(hf_config):
        out.setdefault(family.mlp_width, mlp_width_of(family, hf_config))
    if family.kv_heads and getattr(hf_config, family.kv_heads, None):
        out[family.kv_heads] = int(getattr(hf_config, family.kv_heads))
    for key in family.tp_divides:
        out[key] = int(getattr(hf_config, key))
    return out


def padded_vocab(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """Vocabulary rounded up to a multiple of ``multiple * tp`` (rows added to embedding and head)."""
    m = multiple * tp
    return -(-vocab_size // m) * m
