"""Document-aware packing (``data.packing=documents``), in this process: the row plan (best-fit
decreasing, seeded, plan independent), the rows, position ids and loss counts the sampler builds from
it, what truncation reports, and the model: a packed micro-batch gives, for every family, the loss
and gradients of its records run one per row without padding (fp32, 1e-5), and two identical records
in one row each get the loss they have alone, where stream packing (attention across them) does not."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers.families import SEQ, TINY, VOCAB, one_process_model_of
from helpers.config import compose
from hybridtrain.config import DataConfig
from hybridtrain.config.choices import Packing
from hybridtrain.data.packing import pack, row_positions
from hybridtrain.data.sampler import DocumentSamples, open_samples
from hybridtrain.parallel.dims import BatchLayout
from hybridtrain.errors import PlanError

IGNORE = -100


def skewed_lengths(n: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """Log-normal record lengths with a median of about seq_len / 10, a few at seq_len."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(seq_len / 10), 0.9, n), 2, seq_len).astype(np.int64)


def records(lengths, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Records of ``lengths`` random tokens; the first third of each is an unlabelled prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(1, VOCAB, int(n)).tolist()
        labels = [IGNORE if t < n // 3 else int(x) for t, x in enumerate(rng.integers(1, VOCAB, int(n)))]
        labels[-1] = int(rng.integers(1, VOCAB))  # at least one loss token
        out.append((ids, labels))
    return out


# --- the row plan ---------------------------------------------------------------------------------------

def test_every_record_lands_in_exactly_one_row_that_holds_it():
    lengths = skewed_lengths(3000, 256)
    plan = pack(lengths, 256, seed=1)
    assert sorted(plan.order.tolist()) == list(range(3000))
    per_row = plan.per_row(lengths)
    assert per_row.max() <= 256 and len(plan) == len(per_row)
    fill = lengths.sum() / (len(plan) * 256)
    assert fill > 0.95, fill  # best-fit decreasing leaves little padding on skewed lengths
    assert len(plan) < 3000 / 5  # versus one record per row


def test_the_plan_is_a_function_of_lengths_and_seed():
    lengths = skewed_lengths(500, 128)
    a, b, other = pack(lengths, 128, 7), pack(lengths, 128, 7), pack(lengths, 128, 8)
    assert np.array_equal(a.order, b.order) and np.array_equal(a.starts, b.starts)
    assert not np.array_equal(a.order, other.order)  # the seed decides which equal-length records share a row
    assert len(a) == len(other)  # but not how full the rows are


def test_a_record_longer_than_a_row_is_refused():
    with pytest.raises(ValueError, match=r"record lengths must be in \[1, 8\]"):
        pack(np.array([3, 9]), 8, 0)


def test_positions_restart_at_every_record_and_at_the_padding():
    assert row_positions(np.array([3, 2]), 8).tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert row_positions(np.array([4, 4]), 8).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]  # a full row


# --- the sampler -------------------------------------------------------------------------------------

def test_rows_hold_whole_records_with_their_labels():
    recs = records([5, 3, 9, 4, 2, 7], seed=2)
    samples = DocumentSamples.from_records(recs, seq_len=12, seed=3, pad_id=99)
    seen = []
    idx = np.arange(samples.num_samples)
    inputs, labels = samples.rows(idx)
    positions = samples.positions(idx)
    for k, row in enumerate(idx):
        at = 0
        for r in samples.records(row):
            ids, lab = recs[r]
            assert inputs[k, at:at + len(ids)].tolist() == ids and labels[k, at:at + len(ids)].tolist() == lab
            assert positions[k, at:at + len(ids)].tolist() == list(range(len(ids)))
            at += len(ids)
            seen.append(int(r))
        assert (inputs[k, at:] == 99).all() and (labels[k, at:] == IGNORE).all()  # padding: no loss
    assert sorted(seen) == list(range(len(recs)))
    want = [sum(sum(t != IGNORE for t in recs[r][1]) for r in samples.records(row)) for row in idx]
    assert samples.label_counts(idx).tolist() == want == (labels != IGNORE).sum(axis=1).tolist()


def test_every_layout_sees_the_same_packed_rows():
    samples = DocumentSamples.from_records(records(skewed_lengths(400, 64)), seq_len=64, seed=5)
    want = [samples.global_indices(step, 8) for step in range(4)]
    for dp, micro in [(1, 1), (2, 1), (1, 4), (2, 2), (4, 2)]:
        layout = BatchLayout(8, micro, dp)
        for step in range(4):
            parts = [[(x, pos) for (x, pos), _ in samples.micro_batches(step, layout, r)] for r in range(dp)]
            got_x = torch.stack([torch.stack([x for x, _ in p]) for p in parts], dim=1).reshape(8, 64)
            got_pos = torch.stack([torch.stack([pos for _, pos in p]) for p in parts], dim=1).reshape(8, 64)
            want_x, _ = samples.rows(want[step])
            assert torch.equal(got_x, torch.from_numpy(want_x)), (dp, micro, step)
            assert torch.equal(got_pos, torch.from_numpy(samples.positions(want[step])))


def test_the_weight_makes_the_step_loss_the_global_token_mean():
    samples = DocumentSamples.from_records(records(skewed_lengths(100, 32)), seq_len=32, seed=0)
    idx = samples.global_indices(0, 8)
    for layout in (BatchLayout(8, 1, 1), BatchLayout(8, 2, 2)):
        weight = samples.batch_weight(idx, layout)
        assert weight == pytest.approx(layout.grad_accum * layout.dp / samples.label_counts(idx).sum())


# --- preparation: what truncation does, reported --------------------------------------------------------

def _prepare(tmp_path, rows: list[dict], **data) -> dict:
    from hybridtrain.data.prepare import prepare

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = []
    prepared = prepare(DataConfig(source="files", path=str(path), cache_dir=str(tmp_path / "cache"), **data), 0,
                       log=lines.append)
    return {"meta": json.loads(prepared.to_json()), "log": "\n".join(lines)}


def test_prompt_completion_records_are_packed_and_long_ones_truncated_with_a_count(tmp_path):
    rows = [{"prompt": "Who begat Enos? ", "completion": "Seth begat Enos."} for _ in range(20)]
    rows += [{"prompt": "Recite. ", "completion": "and the earth " * 40}]  # far past seq_len=32
    out = _prepare(tmp_path, rows, format="prompt_completion", seq_len=32)
    meta, train = out["meta"], out["meta"]["splits"]["train"]
    assert meta["kind"] == "documents" and train["records"] == 21 and train["num_records"] == 21
    assert train["truncated_records"] == 1 and train["cut_tokens"] > 0 and train["dropped_records"] == 0
    assert train["num_samples"] < 21 and 0 < train["fill"] <= 1
    assert "packing documents: train 21 records in" in out["log"] and "1 truncated (" in out["log"]
    samples = open_samples(meta, "train", 0)
    assert samples.num_samples == train["num_samples"]
    assert int(samples.label_counts(np.arange(samples.num_samples)).sum()) > 0


def test_text_documents_longer_than_a_row_are_split_not_cut(tmp_path):
    from hybridtrain.data.tokenizer import load_tokenizer

    text = "In the beginning God created the heaven and the earth. " * 6
    out = _prepare(tmp_path, [{"text": text}, {"text": "Amen."}], packing="documents", seq_len=16)
    train = out["meta"]["splits"]["train"]
    tok = load_tokenizer(DataConfig())
    n, m = (len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in (text, "Amen."))  # with EOS
    assert train["split_records"] == 1 and train["truncated_records"] == 0 and train["cut_tokens"] == 0
    assert train["num_records"] == 1 + -(-(n - 1) // 16)  # pieces of 17 tokens overlapping by one, plus "Amen."
    samples = open_samples(out["meta"], "train", 0)
    assert int(samples.label_counts(np.arange(samples.num_samples)).sum()) == (n - 1) + (m - 1)  # every token learned
    assert "1 split into pieces of 16" in out["log"]


def test_unpacked_rows_report_truncation_too(tmp_path):
    out = _prepare(tmp_path, [{"text": "word " * 50}, {"text": "short"}], packing="none", seq_len=8)
    train = out["meta"]["splits"]["train"]
    assert out["meta"]["kind"] == "rows" and train["num_samples"] == 2 and train["truncated_records"] == 1
    assert "packing none: train 2 records (1 truncated (" in out["log"]


@pytest.mark.parametrize("value, fmt, want", [
    (None, "text", Packing.stream), (None, "chat", Packing.documents), (None, "prompt_completion", Packing.documents),
    (True, "text", Packing.stream), ("True", "chat", Packing.documents), (False, "chat", Packing.none),
    ("documents", "text", Packing.documents), ("none", "text", Packing.none)])
def test_packing_values_old_and_new(value, fmt, want):
    assert Packing.of(value, fmt) is want


def test_packing_errors_name_the_key():
    with pytest.raises(PlanError, match=r"^data.packing: 'yes' is not one of \[documents, stream, none\]"):
        compose("+recipe=gpt_tiny", "data.packing=yes")
    with pytest.raises(PlanError, match=r"^data.packing: stream joins documents .* data.format=text only"):
        compose("+recipe=gpt_tiny", "data.format=chat", "data.packing=stream")
    assert compose("+recipe=gpt_tiny", "data.packing=false").data.packing is Packing.none


# --- the model: packed rows are exact ------------------------------------------------------------------

def _model(folder):
    return one_process_model_of(folder).eval()


def _loss_and_grads(model, batches, weight: torch.Tensor):
    """Summed weighted loss of ``batches`` ``[(input_ids, position_ids, labels)]`` and the summed gradients."""
    model.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for x, pos, y in batches:
        loss = model((x, pos), (y, weight))
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(TINY))
def test_packed_rows_give_the_loss_and_gradients_of_their_records_alone(family, family_folders):
    recs = records([11, 7, 9, 20, 12, 3, 25], seed=4)  # rows of SEQ=32 with padding; windows of 8 bind
    samples = DocumentSamples.from_records(recs, seq_len=SEQ, seed=1)
    assert samples.num_samples < len(recs)  # really packed
    idx = np.arange(samples.num_samples)
    x, y = (torch.from_numpy(a) for a in samples.rows(idx))
    pos = torch.from_numpy(samples.positions(idx))
    weight = torch.tensor(1.0 / int((y != IGNORE).sum()))
    model = _model(family_folders[family])
    packed_loss, packed_grads = _loss_and_grads(model, [(x, pos, y)], weight)
    alone = [(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([lab])) for ids, lab in recs]
    alone_loss, alone_grads = _loss_and_grads(model, alone, weight)
    assert abs(float(packed_loss) - float(alone_loss)) <= 1e-5 * abs(float(alone_loss)), (packed_loss, alone_loss)
    assert packed_grads.keys() == alone_grads.keys() and packed_grads
    for name, g in alone_grads.items():
        diff = float((packed_grads[name] - g).abs().max())
        assert diff <= 1e-5 * max(float(g.abs().max()), 1e-3), f"{family} {name}: max |diff| {diff:.3g}"


def _token_losses(model, x, pos, y) -> torch.Tensor:
    with torch.no_grad():
        logits = model.logits((x, pos)).float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3_5_text"])  # Qwen3.5: the recurrent state and conv window
def test_two_identical_records_each_get_their_own_loss_and_stream_packing_does_not(family, family_folders):
    (ids, labels), = records([14], seed=9)
    model = _model(family_folders[family])
    alone = _token_losses(model, torch.tensor([ids]), torch.arange(14)[None], torch.tensor([labels]))[0]
    row_x = torch.tensor([ids + ids + [0] * (SEQ - 28)])
    row_y = torch.tensor([labels + labels + [IGNORE] * (SEQ - 28)])
    documents = torch.from_numpy(row_positions(np.array([14, 14]), SEQ))[None]
    stream = torch.arange(SEQ)[None]  # what data.packing=stream gives a row: one sequence, attention across
    for positions, same in ((documents, True), (stream, False)):
        got = _token_losses(model, row_x, positions, row_y)[0]
        first, second = got[:14], got[14:28]
        assert torch.allclose(first, alone, rtol=1e-5, atol=1e-6)  # nothing precedes the first copy
        close = torch.allclose(second, alone, rtol=1e-5, atol=1e-6)
        assert close is same, f"{family}: second copy {'differs' if same else 'equals'} with positions {positions}"
        if not same:
            assert float((second - alone).abs().max()) > 1e-3  # not a rounding difference


# --- plan rules and the memory estimate -------------------------------------------------------------

def test_flash_attention_without_the_package_is_a_plan_error(monkeypatch):
    import importlib.util

    from hybridtrain.plan import Machine, resolve

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    with pytest.raises(PlanError, match=r"^model.attn_implementation: flash_attention_2 needs the flash-attn package"):
        resolve(compose("+recipe=gpt_tiny", "model.attn_implementation=flash_attention_2"), Machine())


def test_documents_needs_a_kernel_that_keeps_records_apart():
    from hybridtrain.plan.data import DOCUMENT_MASKS, check_packing_kernel
    from hybridtrain.config.choices import AttnImplementation

    assert {str(k) for k in AttnImplementation} <= set(DOCUMENT_MASKS)  # every kernel of the schema can
    data = DataConfig(format="prompt_completion")  # documents by default
    for kernel in DOCUMENT_MASKS:
        check_packing_kernel(data, kernel)
    with pytest.raises(PlanError, match=r"^data.packing: .*model.attn_implementation=flex_attention cannot express"):
        check_packing_kernel(data, "flex_attention")  # a kernel transformers has, without the mask here
    check_packing_kernel(DataConfig(format="prompt_completion", packing="none"), "flex_attention")


def _saved_bytes(block, x: torch.Tensor, positions: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``block((x, positions))``."""
    storages = {}

    def keep(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        block((x, positions))
    return sum(storages.values())


@pytest.mark.parametrize("recipe", ["gpt_tiny", "llama_tiny"])
def test_memory_estimate_follows_what_packing_adds(recipe):
    """Packing changes no activation shape; sdpa keeps the block-causal ``[b, 1, s, s]`` mask for the
    backward, which the estimate adds (``mask``), and with grouped-query heads the keys and values repeated to
    every head (sdpa given a mask does not use its GQA path). Measured on one block: the estimate with packing
    (the measured block without packing plus the estimated mask) is within 10% of the measurement."""
    from hybridtrain.models.build import ModelBuilder
    from hybridtrain.models.stages import DecoderBlock
    from hybridtrain.parallel.context import TPContext
    from hybridtrain.plan import Machine, resolve
    from hybridtrain.models.families import family_of
    from hybridtrain.plan.costs import model_facts
    from hybridtrain.plan.memory import activation_bytes, attention_flags

    b, s = 2, 256
    cfg = compose(f"+recipe={recipe}", "data.packing=documents", f"data.seq_len={s}")
    plan, hf = resolve(cfg, Machine())
    facts = model_facts(family_of(cfg.model), hf, s, 1, cfg.model.vocab_pad_multiple)
    assert attention_flags(cfg, facts, plan.gpus) == {"eager": False, "mask": True}
    block = DecoderBlock(ModelBuilder.for_run(cfg, hf, TPContext(), plan.padded_vocab_size), 0)
    x = torch.randn(b, s, hf.hidden_size, requires_grad=True)
    plain = _saved_bytes(block, x, torch.arange(s).repeat(b, 1))
    packed = _saved_bytes(block, x, torch.from_numpy(np.stack([row_positions(np.array([100, 56, 60]), s)] * b)))
    one_block = [u for u in facts.units if u.kind.name == "BLOCK"][:1]
    added = (activation_bytes(one_block, facts, b, 1, "fp32", False, False, mask=True)
             - activation_bytes(one_block, facts, b, 1, "fp32", False, False, mask=False))
    repeated = 2 * 4 * b * (facts.q_dim - facts.kv_dim) * s  # sdpa given a mask repeats grouped KV heads (fp32)
    assert added == s * s * b * 4 + repeated  # [b, 1, s, s] fp32, and the repeated keys and values
    if recipe == "gpt_tiny":  # multi-head attention: the mask is all packing adds
        assert packed - plain == added
    assert abs(plain + added - packed) <= 0.10 * packed, (plain, packed, added)


def test_flash_attention_gets_the_records_as_variable_length_sequences():
    """With ``flash_attention_2`` (GPU only, not run here) each block passes FlashAttention's
    variable-length offsets instead of a mask: one sequence per record, over the flattened batch."""
    from hybridtrain.models.stages import varlen_kwargs

    pos = torch.from_numpy(np.stack([row_positions(np.array([3, 2]), 8), row_positions(np.array([8]), 8)]))
    got = varlen_kwargs(pos)
    assert got["cu_seq_lens_q"].tolist() == got["cu_seq_lens_k"].tolist() == [0, 3, 5, 8, 16]
    assert got["max_length_q"] == got["max_length_k"] == 8
    assert varlen_kwargs(torch.arange(8).repeat(2, 1)) == {}  # one sequence per row: the dense kernel
