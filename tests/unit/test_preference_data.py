"""``data.format=preference`` (``hybridtrain.data.preference``): pairs tokenized as TRL's DPOTrainer does, one
pair per row, bad records refused or counted, the same pairs in the same order under every layout."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hybridtrain.config import DataConfig
from hybridtrain.data import prepare as prep
from hybridtrain.data.embedded import preference_pairs
from hybridtrain.data.preference import pair_ids
from hybridtrain.data.sampler import PairSamples, open_samples
from hybridtrain.data.tokenizer import load_tokenizer
from hybridtrain.parallel.dims import ParallelDims
from hybridtrain.plan import PlanError

from helpers.data import CHAT_PAIRS as CHAT, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DataConfig())


def _cfg(tmp_path: Path, path: Path, **kw) -> DataConfig:
    return DataConfig(source="files", path=str(path), format="preference", cache_dir=str(tmp_path / "cache"),
                      seq_len=kw.pop("seq_len", 96), **kw)


def test_pairs_are_tokenized_as_trl_tokenizes_them(tok, tmp_path):
    """The oracle: TRL 1.16's own ``DPOTrainer._prepare_dataset`` (EOS appended to text completions, prompt and
    prompt + completion tokenized apart, the completion from where they diverge; chat rendered by the template)."""
    from types import SimpleNamespace

    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), max_length=None, report_to=[], bf16=False, use_cpu=True)
    text = preference_pairs(16)
    for records in (text, CHAT):
        theirs = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok), Dataset.from_list(records), tok, args,
                                             "train")  # uses only the tokenizer of the trainer
        for record, row in zip(records, theirs, strict=True):
            assert pair_ids(tok, record["prompt"], record["chosen"], record["rejected"]) == (
                row["prompt_ids"], row["chosen_ids"], row["rejected_ids"])


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_a_pair_is_one_row_of_two_documents_with_loss_on_the_completions(tok, tmp_path, chat):
    records = CHAT if chat else preference_pairs(8)
    folder = prep.prepare(_cfg(tmp_path, write_jsonl(tmp_path / "p.jsonl", records)), 0, log=lambda _: None)
    samples = open_samples(json.loads(folder.to_json()), "train", 0)
    assert isinstance(samples, PairSamples) and samples.num_samples == len(records)
    for i, record in enumerate(records):
        p, c, r = pair_ids(tok, record["prompt"], record["chosen"], record["rejected"])
        ids, labels = (a[0] for a in samples.rows(np.array([i])))
        positions, segments = samples.positions(np.array([i]))[0], samples.segments(np.array([i]))[0]
        nc, nr = len(p) + len(c) - 1, len(p) + len(r) - 1  # each sequence but its last token
        assert list(ids[:nc + nr]) == (p + c)[:-1] + (p + r)[:-1]
        assert list(labels[:nc]) == [-100] * (len(p) - 1) + c and list(labels[nc:nc + nr]) == [-100] * (len(p) - 1) + r
        assert (labels[nc + nr:] == -100).all()
        assert list(positions[:nc + nr]) == list(range(nc)) + list(range(nr))  # attention stays in each sequence
        assert list(segments) == [0] * nc + [1] * nr + [-1] * (96 - nc - nr)
        assert samples.chosen_labels[i] == len(c)


@pytest.mark.parametrize("bad,key,why", [
    ({"rejected": None}, "data.rejected_field", "field 'rejected' missing or null"),
    ({"chosen": ""}, "data.chosen_field", "field 'chosen' is empty"),
    ({"chosen": []}, "data.chosen_field", "field 'chosen' is an empty list of messages"),
    ({"chosen": " and the " * 40}, "data.seq_len", "the pair is longer than data.seq_len=96 tokens"),
])
def test_a_bad_pair_is_refused_naming_the_file_and_record_or_counted(tmp_path, bad, key, why):
    records = preference_pairs(12)
    for i in (3, 9):
        records[i] = {**records[i], **bad}
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    with pytest.raises(PlanError) as info:
        prep.prepare(_cfg(tmp_path, path), 0, log=lambda _: None)
    assert info.value.key == key
    assert f"2 of 12 train" in str(info.value) and f"{path} records 3, 9 (counting from 0)" in str(info.value)
    assert f"2: {why}" in str(info.value)
    kept = prep.prepare(_cfg(tmp_path, path, skip_invalid=True), 0, log=lambda _: None)
    assert kept.skipped["train"]["records"] == 2 and kept.num_samples("train") == 10


def test_every_layout_sees_the_same_pairs_in_the_same_order(tmp_path):
    """A micro-batch holds whole pairs; the pairs of a step, laid out [accumulation, dp, micro], are the same
    global batch under every (dp, micro-batch) cut, and the weights make each step the mean over its pairs."""
    folder = prep.prepare(_cfg(tmp_path, write_jsonl(tmp_path / "p.jsonl", preference_pairs(40))), 0,
                          log=lambda _: None)
    samples = open_samples(json.loads(folder.to_json()), "train", 7)

    def step_pairs(dp: int, micro: int, step: int) -> tuple[list[int], float]:
        layout = ParallelDims(pp=1, dp=dp, cp=1, tp=1).batch_layout(micro_batch_size=micro, global_batch_size=8)
        seen = {}
        for rank in range(dp):
            for k, (_, target) in enumerate(samples.micro_batches(step, layout, rank, weighted=True)):
                labels, weights, segments, reference, index = target
                assert labels.shape == segments.shape == (micro, 96) and reference.shape == (micro, 2)
                seen[(k, rank)] = index.tolist()
                pair_weight = float(weights[0])
        order = [i for key in sorted(seen) for i in seen[key]]
        return order, pair_weight * 8 / (layout.grad_accum * dp)

    for step in (0, 3, 6):  # 40 pairs, 8 a step: step 6 is in the second epoch
        whole, weight = step_pairs(1, 8, step)
        assert weight == pytest.approx(1.0)
        assert step_pairs(2, 2, step)[0] == whole == samples.global_indices(step, 8).tolist()
        assert step_pairs(4, 1, step)[1] == pytest.approx(1.0)


def test_pairs_from_a_saved_dataset_with_messages(tok, tmp_path):
    """``data=disk``: a ``save_to_disk`` folder whose message lists Arrow stores as lists of structs."""
    from datasets import Dataset

    Dataset.from_list(CHAT).save_to_disk(str(tmp_path / "saved"))
    cfg = DataConfig(source="disk", path=str(tmp_path / "saved"), format="preference",
                     cache_dir=str(tmp_path / "cache"), seq_len=96)
    samples = open_samples(json.loads(prep.prepare(cfg, 0, log=lambda _: None).to_json()), "train", 0)
    ids, _ = samples.rows(np.array([1]))
    p, c, r = pair_ids(tok, CHAT[1]["prompt"], CHAT[1]["chosen"], CHAT[1]["rejected"])
    assert list(ids[0][:len(p) + len(c) - 1]) == (p + c)[:-1]
