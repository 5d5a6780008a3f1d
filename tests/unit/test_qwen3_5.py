"""Qwen3.5 (Gated DeltaNet beside gated full attention) without processes: what this version refuses, each refusal
naming its key and the fix (ZeRO-3 with context parallelism, LoRA on ``linear_attn``), what LoRA may adapt, and the document
grouping of packed rows that the Gated DeltaNet blocks run per document (``hybridtrain/models/linear_attention.py``).
The exactness tests are with the other families' (``tests/unit/test_family_logits.py``, ``test_packing.py``,
``tests/dist/test_tp_layers.py``, ``test_family_layouts.py``, ``test_packing_layouts.py``)."""
from __future__ import annotations

import pytest
import torch

from helpers.config import compose
from hybridtrain.plan import Machine, PlanError, apply_pretrained_defaults, resolve

CPU = Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=4)


def _resolve(folder, *overrides: str):
    cfg = compose("+recipe=finetune", f"model.pretrained={folder}", *overrides)
    apply_pretrained_defaults(cfg)
    return resolve(cfg, CPU)


@pytest.mark.parametrize("folders,family", [("family_folders", "qwen3_5_text"), ("hybrid_folders", "qwen3_5_moe_text"),
                                             ("hybrid_folders", "qwen3_next")])
def test_context_parallel_is_planned(folders, family, request):
    """cp > 1 runs (the Gated DeltaNet state passes between the cp ranks: tests/dist/test_cp_gated_deltanet.py)."""
    plan, _ = _resolve(request.getfixturevalue(folders)[family], "data.seq_len=32", "parallel.cp=2", "parallel.tp=2")
    assert (plan.dims.cp, plan.dims.tp) == (2, 2)


def test_context_parallel_with_zero3_is_refused_naming_the_key(family_folders):
    with pytest.raises(PlanError) as info:
        _resolve(family_folders["qwen3_5_text"], "data.seq_len=32", "parallel.cp=2", "parallel.zero_stage=3")
    assert info.value.key == "parallel.zero_stage"
    message = str(info.value)
    assert "qwen3_5_text's Gated DeltaNet blocks pass their recurrent state from cp rank to cp rank" in message
    assert "use parallel.zero_stage=2 (or 1), or parallel.cp=1" in message
    _resolve(family_folders["qwen3_5_text"], "data.seq_len=32", "parallel.cp=2", "parallel.zero_stage=2")


@pytest.mark.parametrize("targets", ["all-linear", "[in_proj_qkv,q_proj]"])
def test_lora_on_gated_deltanet_is_refused_naming_what_may_be_adapted(hybrid_folders, targets):
    """Qwen3.5-MoE: LoRA on ``linear_attn`` not yet proven (Qwen3.5's dense model is: tests/dist/test_lora_peft.py)."""
    with pytest.raises(PlanError) as info:
        _resolve(hybrid_folders["qwen3_5_moe_text"], "finetune.method=lora", f"finetune.lora.target_modules={targets}")
    assert info.value.key == "finetune.lora.target_modules"
    message = str(info.value)
    assert "LoRA on a qwen3_5_moe_text block's linear_attn is not supported in this version" in message, message
    assert "finetune.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,shared_expert_gate]" \
        in message, message


def test_lora_on_qwen3_5_plans_with_every_linear(family_folders, hybrid_folders):
    plan, _ = _resolve(family_folders["qwen3_5_text"], "finetune.method=lora", "parallel.tp=2")  # all-linear
    assert plan.dims.tp == 2
    plan, _ = _resolve(hybrid_folders["qwen3_5_moe_text"], "finetune.method=lora",
                       "finetune.lora.target_modules=[q_proj,v_proj,down_proj]", "parallel.tp=2")
    assert plan.dims.tp == 2


def test_tp_must_divide_the_gated_deltanet_heads():
    # the recipe's 12 query and 6 KV heads, 192-wide MLP: tp=3 divides them, not the 4 Gated DeltaNet key heads
    cfg = compose("+recipe=llama_tiny", "model=qwen3_5_text", "+model.config.head_dim=8",
                  "+model.config.linear_num_key_heads=4", "+model.config.linear_num_value_heads=8", "parallel.tp=3")
    with pytest.raises(PlanError) as info:
        resolve(cfg, CPU)
    assert info.value.key == "parallel.tp"
    assert "parallel.tp=3 must divide model.config.linear_num_key_heads=4" in str(info.value), str(info.value)


def test_documents_are_grouped_by_length_at_every_restart():
    from hybridtrain.models.linear_attention import Documents, run_per_document

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5]])  # [B, S]: docs 3,2,3 | 2,6
    docs = Documents.of(pos)
    got = {n: sorted(zip(r.tolist(), s.tolist())) for n, r, s in docs.groups}
    assert got == {2: [(0, 3), (1, 0)], 3: [(0, 0), (0, 5)], 6: [(1, 2)]}
    assert Documents.of(torch.arange(8).expand(2, 8)) is None  # one document per row
    hidden = torch.randn(2, 8, 3, requires_grad=True)
    # a causal running sum restarts at every document: the per-document result of a prefix sum
    out = run_per_document(lambda x: x.cumsum(1), hidden, docs)
    want = torch.cat([hidden[0, 0:3].cumsum(0), hidden[0, 3:5].cumsum(0), hidden[0, 5:8].cumsum(0)])
    torch.testing.assert_close(out[0], want)
    torch.testing.assert_close(out[1], torch.cat([hidden[1, 0:2].cumsum(0), hidden[1, 2:8].cumsum(0)]))
    out.sum().backward()
    assert hidden.grad is not None and hidden.grad[0, 0, 0] == 3  # token 0 feeds the three sums of its document


def test_rank_chunks_cut_the_documents_at_the_chunk_edges():
    """cp = 2 over rows of 8: rank 0 holds chunks 0 and 3 (tokens 0-1, 6-7), rank 1 chunks 1 and 2 (2-3, 4-5). A
    chunk continues the document before it unless one starts exactly at its first token."""
    from hybridtrain.models.linear_attention import RankChunks
    from hybridtrain.parallel.context import CPContext

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5]])  # [B, S]: docs 3,2,3 | 2,6
    pieces = {}
    for rank in (0, 1):
        chunks = RankChunks.of(pos, CPContext(rank=rank, size=2))
        for name, chunk in zip(("first", "second"), chunks.chunks):
            assert chunk.length == 2
            groups = {n: sorted(zip(r.tolist(), s.tolist())) for n, r, s in chunk.groups}
            pieces[rank, name] = (groups, chunk.continues.tolist())
    assert pieces[0, "first"] == ({2: [(0, 0), (1, 0)]}, [False, False])  # tokens 0-1: every row starts
    assert pieces[1, "first"] == ({1: [(0, 0), (0, 1)], 2: [(1, 0)]}, [True, False])  # 2-3: row 1 starts at 2
    assert pieces[1, "second"] == ({1: [(0, 0), (0, 1)], 2: [(1, 0)]}, [True, True])  # 4-5: row 0 starts at 5
    assert pieces[0, "second"] == ({2: [(0, 0), (1, 0)]}, [True, True])  # 6-7 continue both rows
    whole = RankChunks.of(pos, CPContext(rank=1, size=2), packed=False)  # one document per row: all continue
    assert [c.continues.tolist() for c in whole.chunks] == [[True, True], [True, True]]


@pytest.fixture(scope="module")
def hybrid_folders(family_folders, tmp_path_factory):
    """Qwen3.5's tiny twin and the MoE twins of Qwen3.5-MoE and Qwen3-Next (``tests/helpers/moe.py``)."""
    from helpers.moe import twin_maker

    moe = twin_maker(tmp_path_factory.mktemp("hybrid_moe"))
    return {"qwen3_5_text": family_folders["qwen3_5_text"], "qwen3_5_moe_text": moe("qwen3_5_moe_text"),
            "qwen3_next": moe("qwen3_next")}


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_packed_rows_give_every_document_its_logits_alone(family, hybrid_folders):
    """Two rows of three documents each (3 to 40 tokens, some shorter than the conv window): hybridtrain's logits of each document in its packed row
    equal transformers' logits of the document alone (fp32, 1e-5); transformers' own forward of the packed row, which
    ignores the boundaries in its Gated DeltaNet layers on CPU, gives the later documents other logits."""
    from helpers.families import VOCAB, one_process_model_of
    from transformers import AutoModelForCausalLM

    lengths = [[17, 3, 28], [5, 40, 3]]  # [B] rows of 48 tokens
    gen = torch.Generator().manual_seed(11)
    docs = [[torch.randint(1, VOCAB, (n,), generator=gen) for n in row] for row in lengths]
    ids = torch.stack([torch.cat(row) for row in docs])  # [2, 48]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])  # restarts at every document
    ours = one_process_model_of(hybrid_folders[family]).eval()
    hf = AutoModelForCausalLM.from_pretrained(str(hybrid_folders[family]), dtype=torch.float32).eval()
    with torch.no_grad():
        packed = ours.logits((ids, pos))
        mixed = hf(input_ids=ids, position_ids=pos).logits
        for b, row in enumerate(docs):
            start = 0
            for i, doc in enumerate(row):
                alone = hf(input_ids=doc[None]).logits[0]  # [n, V]
                got = packed[b, start:start + len(doc), :VOCAB]
                scale = alone.abs().max().item()
                assert (got - alone).abs().max().item() <= 1e-5 * scale, (family, b, i)
                if i > 0:  # transformers mixes a later document with the ones before it
                    assert (mixed[b, start:start + len(doc)] - alone).abs().max().item() > 1e-3 * scale, (family, b, i)
                start += len(doc)


VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
"""A one-block vision tower for the tiny vision-language twins."""


def _vision_language_folder(folder, kind: str):
    """``save_pretrained`` of a tiny ``Qwen3_5ForConditionalGeneration`` (``kind="qwen3_5"``) or its MoE twin, its
    language model the tiny text twin's (perturbed weights), plus the embedded tokenizer."""
    from helpers.families import TINY
    from helpers.finetune import save_vision_language
    from helpers.moe import MOE_TINY

    text = TINY["qwen3_5_text"] if kind == "qwen3_5" else MOE_TINY["qwen3_5_moe_text"]
    return save_vision_language(folder, kind, text, vision_config=VISION)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_a_vision_language_folder_trains_its_extracted_language_model(kind, tmp_path):
    """The published folder is refused naming ``model.pretrained`` and the command; the command's folder holds the
    language model only, and hybridtrain's logits of it equal the vision-language model's on text (fp32, 1e-5)."""
    from safetensors import safe_open

    from helpers.families import SEQ, VOCAB, one_process_model_of
    from hybridtrain.extract_text import command, main

    src = tmp_path / "published"
    model = _vision_language_folder(src, kind)
    with pytest.raises(PlanError) as info:
        _resolve(src)
    assert info.value.key == "model.pretrained"
    assert "vision-language model; hybridtrain trains its language model" in str(info.value)
    assert f"extract it first with `{command(src)}`" in str(info.value)
    dst = tmp_path / "published-text"
    assert command(src).split()[-2:] == [str(src), str(dst)]
    assert main([str(src), str(dst)]) == 0
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    with safe_open(str(src / "model.safetensors"), "pt") as f:  # as saved (MoE experts one by one, as published)
        want = {n.replace("model.language_model.", "model.") for n in f.keys() if not n.startswith("model.visual.")}
    assert names == want and len(want) > 50  # every language-model tensor, no vision tower
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        got = one_process_model_of(dst).eval().logits(ids)
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    plan, _ = _resolve(dst, "parallel.tp=2")  # the extracted folder plans
    assert plan.dims.tp == 2


def test_gated_deltanet_blocks_cost_their_recurrence_not_attention_over_the_row():
    """The plan's FLOPs (cost model, balanced partition, MFU): a Gated DeltaNet block's token mixer costs the same
    per token at any row length (its state ``Hv x dk x dv``), a full-attention block's grows with the row."""
    from helpers.families import hf_config
    from hybridtrain.models.families import get_family
    from hybridtrain.plan.flops import block_forward_flops

    family, config = get_family("qwen3_5_text"), hf_config("qwen3_5_text")
    linear, full = family.variant_of(config, 0), family.variant_of(config, 3)
    assert (linear, full) == ("linear_attention", "full_attention")
    state = 8 * 16 * 8  # Hv x dk x dv of the tiny twin
    for seq in (32, 4096):
        assert block_forward_flops(family, config, seq, 100.0, linear) == 100.0 + 6 * state
        assert block_forward_flops(family, config, seq, 100.0, full) == 100.0 + 2 * seq * 8 * (16 + 16)
