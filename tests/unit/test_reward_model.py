"""``finetune.objective=reward``: the scalar head starts as transformers' (and TRL's), the pairs are TRL's
``RewardTrainer`` sequences scored where transformers pools, the loss is TRL's formula, and the plan refuses what
cannot run (``hybridtrain.models.score``, ``hybridtrain.data.preference.scored_rows``,
``hybridtrain.objectives.reward``, ``hybridtrain.plan.reward``)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridtrain.config import DataConfig
from hybridtrain.data import prepare as prep
from hybridtrain.data.embedded import preference_pairs
from hybridtrain.data.preference import score_index
from hybridtrain.data.sampler import PairSamples, open_samples
from hybridtrain.data.tokenizer import load_tokenizer
from hybridtrain.plan import PlanError, resolve
from hybridtrain.plan.machine import machine_facts

from helpers.config import compose
from helpers.families import SEQ, TINY, VOCAB, one_process_model_of
from helpers.data import write_jsonl

CHAT = [{"prompt": [{"role": "user", "content": "Who made the light?"}],
         "chosen": [{"role": "assistant", "content": "God said, Let there be light."}],
         "rejected": [{"role": "assistant", "content": "Nobody at all"}]},
        {"prompt": [{"role": "system", "content": "You recite scripture."}, {"role": "user", "content": "And then?"}],
         "chosen": [{"role": "assistant", "content": "And there was light."}],
         "rejected": [{"role": "assistant", "content": "Darkness"}]}]

REWARD = ("data.format=preference", "finetune.objective=reward")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_head_starts_as_transformers_adds_it_under_set_seed(family, tmp_path):
    """What ``AutoModelForSequenceClassification.from_pretrained(causal-LM folder, num_labels=1)`` draws for the
    missing ``score`` after ``set_seed(seed)`` (TRL's ``RewardTrainer``), bit for bit; another seed differs."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, set_seed

    from helpers.finetune import make_checkpoint
    from hybridtrain.models.hf_model import meta_model
    from hybridtrain.models.score import initial_score
    from hybridtrain.models.weights import CheckpointError, SafetensorsWeights

    folder = make_checkpoint(tmp_path / family, family)
    config = AutoConfig.from_pretrained(str(folder))
    hidden = config.hidden_size
    ours = initial_score(meta_model(config), hidden, 5, SafetensorsWeights(folder))
    set_seed(5)
    theirs = AutoModelForSequenceClassification.from_pretrained(str(folder), num_labels=1, dtype=torch.float32)
    assert torch.equal(ours, theirs.score.weight.detach())
    assert not torch.equal(initial_score(meta_model(config), hidden, 6), ours)
    theirs.save_pretrained(str(tmp_path / "classifier"))  # a reward model's folder: its head is read, not drawn
    read = initial_score(meta_model(config), hidden, 6, SafetensorsWeights(tmp_path / "classifier"))
    assert torch.equal(read, ours)
    AutoModelForSequenceClassification.from_pretrained(str(folder), num_labels=2).save_pretrained(str(tmp_path / "two"))
    with pytest.raises(CheckpointError, match=r"but a reward model's head is \[1, "):
        initial_score(meta_model(config), hidden, 6, SafetensorsWeights(tmp_path / "two"))


INIT_DIFFERS = {"qwen3_5_text"}
"""Families whose ``from_pretrained`` draws other random values before the new head (Qwen3.5's linear-attention
parameters), so the head ``set_seed(seed)`` gives there is not the generator's first draw; hybridtrain's is."""


@pytest.mark.parametrize("family", sorted(TINY))
def test_every_familys_scores_equal_its_sequence_classifier(family, family_folders):
    """hybridtrain's one-process reward model (the head on the final norm's output) of each family's tiny folder
    gives ``AutoModelForSequenceClassification``'s pooled scores, fp32, 1e-5 relative; the head is the one
    transformers draws after ``set_seed`` but in :data:`INIT_DIFFERS` (there both take hybridtrain's); the classifier
    has the causal LM's tensor names plus ``score.weight`` (what the export writes)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, set_seed

    folder = family_folders[family]
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))  # [B, S]
    ids[1, SEQ - 5:] = 0  # a shorter second row, right-padded with the pad (= EOS) token 0
    ours = one_process_model_of(folder, "finetune.objective=reward", "data.format=preference", "trainer.seed=5").eval()
    with torch.no_grad():
        scores = ours.outputs(ids)  # [B, S]: every token's score
    set_seed(5)
    theirs = AutoModelForSequenceClassification.from_pretrained(str(folder), num_labels=1, dtype=torch.float32,
                                                                pad_token_id=0).eval()
    head = ours.head.weight.detach()
    assert torch.equal(head, theirs.score.weight.detach()) is (family not in INIT_DIFFERS)
    with torch.no_grad():
        theirs.score.weight.copy_(head)  # a no-op but in INIT_DIFFERS
        want = theirs(input_ids=ids).logits.squeeze(-1)  # [B]
    got = scores[torch.arange(2), torch.tensor([SEQ - 1, SEQ - 6])]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (family, got, want)
    causal = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert set(theirs.state_dict()) - {"score.weight"} == {n for n in causal.state_dict() if not n.startswith("lm_head")}


def test_score_index_is_where_transformers_pools():
    """The rightmost token that is not the pad token (``(arange x non_pad).argmax()``), 0 if all are pad."""
    assert score_index([5, 6, 7, 0], pad_id=0) == 2  # pad = EOS: the token before the EOS
    assert score_index([5, 0, 7, 0, 0], pad_id=0) == 2
    assert score_index([5, 6, 7, 0], pad_id=9) == 3
    assert score_index([0, 0], pad_id=0) == 0
    ids = torch.tensor([[5, 0, 7, 0, 0]])
    assert int((torch.arange(5) * (ids != 0)).argmax(-1)) == 2  # transformers' own expression


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_a_pair_is_trls_two_whole_sequences_scored_at_their_last_token(chat, tmp_path):
    """The oracle: TRL 1.16's own ``RewardTrainer._prepare_dataset`` (text: EOS appended, ``prompt + chosen``
    tokenized whole; chat: ``prompt + chosen`` rendered by the template)."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    tok = load_tokenizer(DataConfig())
    records = CHAT if chat else preference_pairs(8)
    args = RewardConfig(output_dir=str(tmp_path / "trl"), max_length=None, report_to=[], bf16=False, use_cpu=True)
    theirs = RewardTrainer._prepare_dataset(None, Dataset.from_list(records), tok, args, "train")
    cfg = DataConfig(source="files", path=str(write_jsonl(tmp_path / "p.jsonl", records)), format="preference",
                     cache_dir=str(tmp_path / "cache"), seq_len=96)
    prepared = prep.prepare(cfg, 0, log=lambda _: None, pairs="scored")
    assert prepared.fingerprint != prep.prepare(cfg, 0, log=lambda _: None).fingerprint  # not DPO's rows
    samples = open_samples(json.loads(prepared.to_json()), "train", 0)
    assert isinstance(samples, PairSamples) and samples.num_samples == len(records)
    pad = prepared.pad_id
    for i, row in enumerate(theirs):
        c, r = row["chosen_ids"], row["rejected_ids"]
        ids, labels = (a[0] for a in samples.rows(np.array([i])))
        assert list(ids[:len(c) + len(r)]) == c + r and (ids[len(c) + len(r):] == pad).all()
        marked = np.flatnonzero(labels != -100)
        assert list(marked) == [score_index(c, pad), len(c) + score_index(r, pad)]
        assert list(samples.segments(np.array([i]))[0][:len(c) + len(r)]) == [0] * len(c) + [1] * len(r)
        assert list(samples.positions(np.array([i]))[0][:len(c) + len(r)]) == list(range(len(c))) + list(range(len(r)))


def test_a_pair_longer_than_seq_len_counts_every_token(tmp_path):
    """A reward pair takes its sequences' every token (DPO's takes one less each): refused naming data.seq_len."""
    tok = load_tokenizer(DataConfig())
    record = preference_pairs(1)[0]
    whole = sum(len(tok(text=record["prompt"] + x + tok.eos_token)["input_ids"]) for x in (record["chosen"],
                                                                                       record["rejected"]))
    cfg = DataConfig(source="files", path=str(write_jsonl(tmp_path / "p.jsonl", [record])), format="preference",
                     cache_dir=str(tmp_path / "cache"), seq_len=whole - 1)
    prep.prepare(cfg, 0, log=lambda _: None)  # DPO's row fits (whole - 2 tokens)
    with pytest.raises(PlanError) as info:
        prep.prepare(cfg, 0, log=lambda _: None, pairs="scored")
    assert info.value.key == "data.seq_len" and f"the longest such pair takes {whole} tokens" in str(info.value)


def test_records_with_a_margin_field_are_refused(tmp_path):
    """TRL subtracts a record's ``margin`` from its reward difference; hybridtrain does not read it: refused."""
    records = [dict(r, margin=0.5) for r in preference_pairs(4)]
    cfg = DataConfig(source="files", path=str(write_jsonl(tmp_path / "p.jsonl", records)), format="preference",
                     cache_dir=str(tmp_path / "cache"), seq_len=96)
    prep.prepare(cfg, 0, log=lambda _: None)  # DPO has no margin: the field is not read
    with pytest.raises(PlanError) as info:
        prep.prepare(cfg, 0, log=lambda _: None, pairs="scored")
    assert info.value.key == "data.path" and "the records have a 'margin' field" in str(info.value)


def test_the_loss_is_trls_bradley_terry_with_centring():
    from types import SimpleNamespace

    from hybridtrain.objectives.reward import RewardLoss
    from hybridtrain.parallel.context import CPContext

    scores = torch.tensor([[0.0, 0.3, 9.0, -0.2, 9.0], [0.5, 9.0, 0.1, 9.0, 9.0]], requires_grad=True)
    labels = torch.tensor([[-100, 1, -100, 1, -100], [1, -100, 1, -100, -100]])
    segments = torch.tensor([[0, 0, 1, 1, -1], [0, 0, 1, 1, -1]])
    loss = RewardLoss(CPContext(), SimpleNamespace(center_rewards_coefficient=0.1))
    weights = torch.tensor([1 / 2, 0.0])  # one process, a global batch of these 2 pairs
    got = loss(scores, (labels, weights, segments, torch.zeros(2, 2), torch.arange(2)))
    chosen, rejected = torch.tensor([0.3, 0.5]), torch.tensor([-0.2, 0.1])
    want = -torch.nn.functional.logsigmoid(chosen - rejected).mean() + 0.1 * ((chosen + rejected) ** 2).mean()
    assert torch.allclose(got, want)
    got.backward()
    assert scores.grad[0, 0] == 0 and scores.grad[0, 1] != 0  # only the pooled positions
    stats = loss.take_stats("cpu")
    assert stats.tolist() == pytest.approx([2.0, 0.5 + 0.4, (0.1 + 0.6) / 2, 2.0])


@pytest.mark.parametrize("overrides,key,fragment", [
    pytest.param(("finetune.objective=reward",), "finetune.objective",
                 "reward trains on preference pairs, but data.format=text", id="reward_without_pairs"),
    pytest.param(REWARD + ("data.packing=none",), "data.packing", "a preference pair is one row", id="unpacked"),
    pytest.param(REWARD + ("data.val_fraction=0.1",), "data.val_fraction",
                 "validation of finetune.objective=reward is not supported yet", id="validation"),
    pytest.param(REWARD + ("finetune.method=lora",), "finetune.method",
                 "lora with finetune.objective=reward is not supported yet", id="lora"),
    pytest.param(REWARD + ("trainer.save_logits=true",), "trainer.save_logits", "a reward model has no logits to save",
                 id="save_logits"),
    pytest.param(REWARD + ("finetune.reward.center_rewards_coefficient=-1",),
                 "finetune.reward.center_rewards_coefficient", "must be >= 0 or null", id="center"),
    pytest.param(REWARD + ("+recipe=llama_tiny", "model=olmoe"), "finetune.objective",
                 "transformers has no ForSequenceClassification model for model_type 'olmoe'", id="no_classifier"),
    pytest.param(REWARD + ("+recipe=llama_tiny", "model=qwen3_moe", "+model.config.output_router_logits=true"),
                 "model.config.output_router_logits", "adds no router load-balancing loss", id="moe_aux"),
])
def test_the_plan_refuses_what_a_reward_model_cannot_run(overrides, key, fragment):
    recipe = () if "+recipe=llama_tiny" in overrides else ("+recipe=gpt_tiny",)
    with pytest.raises(PlanError) as info:
        resolve(compose(*recipe, *overrides), machine_facts())
    assert info.value.key == key and fragment in str(info.value)


def test_a_reward_model_plans():
    plan, _ = resolve(compose("+recipe=gpt_tiny", *REWARD, "parallel.tp=2", "parallel.pp=2"), machine_facts())
    assert (plan.dims.tp, plan.dims.pp) == (2, 2)


def test_the_saved_config_is_a_sequence_classifier():
    from transformers import AutoConfig

    from hybridtrain.plan.reward import classifier_config

    base = AutoConfig.for_model("llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=8)
    config = classifier_config(base, pad_id=3)
    assert (config.architectures, config.num_labels, config.pad_token_id) == (["LlamaForSequenceClassification"], 1, 3)
    assert base.pad_token_id is None and base.num_labels == 2  # the model's own config is left alone
