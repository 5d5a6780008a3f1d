"""The attention families of issue 44 (SmolLM3, OLMo 3, Gemma 3's language model) beyond the loops over every family
(logits, packing, LoRA targets, seeded init, shapes, layouts): the published Gemma 3 vision-language folder, the
refusals, ``model.family=auto`` on Gemma 3, and the plan's FLOPs against torch's FLOP counter."""
from __future__ import annotations

import pytest
import torch

from helpers.config import compose
from helpers.families import SEQ, TINY, VOCAB, hf_config, one_process_model_of
from hybridtrain.plan import Machine, PlanError, apply_pretrained_defaults, resolve

CPU = Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=4)
NEW = ("smollm3", "olmo3", "gemma3_text")


def _resolve(folder, *overrides: str):
    cfg = compose("+recipe=finetune", f"model.pretrained={folder}", *overrides)
    apply_pretrained_defaults(cfg)
    return resolve(cfg, CPU)


# -- Gemma 3: the published vision-language folder -------------------------------------------------------------

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
"""A one-block SigLIP tower for the tiny Gemma 3 twin (2 x 2 patches, pooled to ``mm_tokens_per_image=4``)."""


def _gemma3_vision_language_folder(folder):
    """``save_pretrained`` of a tiny ``Gemma3ForConditionalGeneration`` (``model_type`` ``gemma3``) whose language
    model is the tiny ``gemma3_text`` twin (perturbed weights), plus the embedded tokenizer. transformers writes its
    tensors as the published folders hold them (``language_model.model.*``, the head tied)."""
    from helpers.finetune import save_vision_language

    return save_vision_language(folder, "gemma3", TINY["gemma3_text"], vision_config=VISION, mm_tokens_per_image=4)


def test_the_published_gemma3_folder_is_refused_and_its_extracted_language_model_trains(tmp_path):
    """The vision-language folder is refused naming ``model.pretrained`` and the command; the command's folder holds
    the language model only (no vision tower, no projector), and hybridtrain's logits of it equal the
    vision-language model's on text (fp32, 1e-5); it plans at tp = 2."""
    from safetensors import safe_open

    from hybridtrain.extract_text import command, main

    src = tmp_path / "gemma-3-4b"
    model = _gemma3_vision_language_folder(src)
    with pytest.raises(PlanError) as info:
        _resolve(src)
    assert info.value.key == "model.pretrained"
    message = str(info.value)
    assert "'gemma3' vision-language model; hybridtrain trains its language model (Gemma3ForCausalLM)" in message
    assert f"extract it first with `{command(src)}`" in message
    dst = tmp_path / "gemma-3-4b-text"
    assert main([str(src), str(dst)]) == 0
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        published = list(f.keys())
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(n.startswith("language_model.model.") for n in published)  # the published layout
    want = {n.replace("language_model.model.", "model.") for n in published if n.startswith("language_model.")}
    assert names == want and len(want) > 50  # every language-model tensor, no vision tower or projector
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        got = one_process_model_of(dst).eval().logits(ids)
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    plan, _ = _resolve(dst, "parallel.tp=2")
    assert plan.dims.tp == 2


def test_extract_reads_the_current_layout_too(tmp_path):
    """A folder whose language model lies under ``model.language_model.`` (what transformers loads both layouts
    into) extracts to the same tensors."""
    from safetensors.torch import load_file, save_file

    from hybridtrain.extract_text import extract

    src = tmp_path / "published"
    _gemma3_vision_language_folder(src)
    old = load_file(str(src / "model.safetensors"))
    renamed = {n.replace("language_model.model.", "model.language_model."): t for n, t in old.items()}
    save_file(renamed, str(src / "model.safetensors"), metadata={"format": "pt"})
    dst = extract(src, tmp_path / "text")
    got = load_file(str(dst / "model.safetensors"))
    assert set(got) == {n.replace("language_model.model.", "model.") for n in old if n.startswith("language_model.")}


def test_bidirectional_gemma3_is_refused_naming_the_key(family_folders):
    with pytest.raises(PlanError) as info:
        _resolve(family_folders["gemma3_text"], "data.seq_len=32", "++model.config.use_bidirectional_attention=true")
    assert info.value.key == "model.config.use_bidirectional_attention"
    assert "an embedding model" in str(info.value) and "set model.config.use_bidirectional_attention=false" in str(
        info.value)


@pytest.mark.parametrize("family", NEW)
def test_context_parallel_plans(family, family_folders):
    """Nothing in the three families is refused at cp = 2 (their layouts run in tests/dist/test_family_layouts.py)."""
    plan, _ = _resolve(family_folders[family], "data.seq_len=32", "parallel.cp=2", "parallel.tp=2")
    assert plan.dims.cp == 2


# -- model.family=auto --------------------------------------------------------------------------------------------

def test_auto_derives_gemma3_as_the_verified_family_and_passes_the_self_check():
    """The per-layer-type rotary embedding made the self-check end in a TypeError (issue 44); the blocks now ask it
    for their own layer type, and the derived adapter matches transformers on the twin."""
    from transformers import AutoConfig

    from hybridtrain.models.families import get_family
    from hybridtrain.models.families.auto import derive
    from hybridtrain.models.selfcheck import self_check

    derived, verified = derive("gemma3_text"), get_family("gemma3_text")
    for key in ("embed", "blocks", "final_norm", "head", "rotary_embed", "attention", "embed_scale", "kv_heads"):
        assert getattr(derived, key) == getattr(verified, key), key
    assert derived.tp_plan == verified.tp_plan
    hf = AutoConfig.for_model("gemma3_text")
    hf._attn_implementation = "sdpa"
    assert self_check(derived, hf, tps=(1,))[1] <= 1e-5


def test_auto_refuses_a_model_whose_modules_raise_with_the_reason(monkeypatch):
    """Whatever hybridtrain's model of the twin raises (here: the rotary embedding called without its layer type,
    the bug of issue 44) is a plan error naming ``model.family`` and the exception, not a traceback."""
    from transformers import AutoConfig

    from hybridtrain.models import stages
    from hybridtrain.plan import check_derived_family

    monkeypatch.setattr(stages, "rotary_layer_type", lambda rotary, config, index: None)
    cfg = compose("+recipe=gpt_tiny", "model.model_type=gemma3_text", "model.family=auto", "model.config={}")
    hf = AutoConfig.for_model("gemma3_text")
    hf._attn_implementation = "sdpa"
    with pytest.raises(PlanError) as info:
        check_derived_family(cfg, hf)
    assert info.value.key == "model.family"
    message = str(info.value)
    assert "cannot run this model: hybridtrain's model of the twin fails at tp=1" in message
    assert "TypeError" in message and "layer_type" in message


# -- FLOPs ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", NEW)
def test_plan_flops_equal_torchs_flop_counter(family):
    """The plan's forward FLOPs per token (its cost model, partition and MFU) equal what torch's FLOP counter counts
    in transformers' eager forward of the family's tiny twin: every matmul of the blocks and the head, the attention
    over the whole row (sliding windows are not discounted, as causal masking is not; eager computes the whole
    ``[s, s]`` matrix)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from hybridtrain.models.families import get_family
    from hybridtrain.plan.flops import TRAIN_FACTOR, model_flops_per_token

    config = hf_config(family)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids)
    counted = counter.get_total_flops() / SEQ
    planned = model_flops_per_token(get_family(family), config, SEQ, VOCAB) / TRAIN_FACTOR
    assert planned == pytest.approx(counted, rel=1e-9), (planned, counted)


# -- activation memory ---------------------------------------------------------------------------------------------

def test_smollm3_nope_blocks_are_within_the_estimate():
    """The constants are fitted on two rotary blocks (``bench/activations.py``); a model whose every other block is
    NoPE (twice the real share) keeps what the plan estimates within 10% (NoPE blocks keep no more)."""
    from bench.activations import estimate, measure, measured_peak

    row = measure("smollm3", 1024, precision="bf16", shape=dict(num_hidden_layers=4, no_rope_layer_interval=2))
    assert abs(estimate(row) / measured_peak(row) - 1) <= 0.10
    assert estimate(row) >= measured_peak(row) * 0.99  # counted as rotary blocks: not under
