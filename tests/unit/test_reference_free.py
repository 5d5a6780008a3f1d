"""``finetune.objective=cpo`` / ``orpo`` without processes: pairs tokenized as TRL's ``CPOTrainer`` /
``ORPOTrainer`` ``tokenize_row``, the losses equal TRL's own loss functions, ORPO's NLL over the chosen prompt,
and the plan's refusals."""
from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridtrain.config import DataConfig
from hybridtrain.config.schema import CPOConfig, ORPOConfig
from hybridtrain.data import prepare as prep
from hybridtrain.data.embedded import preference_pairs
from hybridtrain.data.preference import cpo_sequences, pair_problem
from hybridtrain.data.sampler import open_samples
from hybridtrain.data.tokenizer import load_tokenizer
from hybridtrain.objectives.reference_free import ReferenceFreeLoss, cpo_pair_loss, log1mexp
from hybridtrain.parallel.context import TPContext
from hybridtrain.parallel.layers import VocabParallelLoss
from hybridtrain.plan import PlanError, resolve
from hybridtrain.plan.machine import machine_facts

from helpers.config import compose
from helpers.data import CHAT_PAIRS as CHAT, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DataConfig())


def _with_bos(tok):
    """The embedded tokenizer with a BOS token (it has none): TRL's CPO prepends it to every prompt."""
    other = copy.deepcopy(tok)
    other.bos_token = other.eos_token
    return other


@pytest.mark.parametrize("trainer", ["cpo", "orpo"])
@pytest.mark.parametrize("bos", [False, True], ids=["no_bos", "bos"])
def test_pairs_are_tokenized_as_trls_tokenize_row(tok, trainer, bos):
    """The oracle: TRL 1.16's ``CPOTrainer.tokenize_row`` / ``ORPOTrainer.tokenize_row`` themselves (after TRL's
    ``maybe_apply_chat_template`` for messages), each sequence with its own prompt, BOS and EOS tokens added."""
    from trl.data_utils import maybe_apply_chat_template

    if trainer == "cpo":
        from trl.experimental.cpo import CPOTrainer as Trainer
    else:
        from trl.experimental.orpo import ORPOTrainer as Trainer
    tokenizer = _with_bos(tok) if bos else tok
    stub = SimpleNamespace(processing_class=tokenizer, is_encoder_decoder=False, max_length=10**6)
    stub.build_tokenized_answer = lambda prompt, answer: Trainer.build_tokenized_answer(stub, prompt, answer)
    records = preference_pairs(16) + CHAT + [{"prompt": "", "chosen": " light", "rejected": " dark"}]
    for record in records:
        row = Trainer.tokenize_row(stub, maybe_apply_chat_template(dict(record), tokenizer))
        p, c, q, r = cpo_sequences(tokenizer, record["prompt"], record["chosen"], record["rejected"])
        assert row["chosen_input_ids"] == p + c and row["rejected_input_ids"] == q + r
        assert row["chosen_labels"] == [-100] * len(p) + c and row["rejected_labels"] == [-100] * len(q) + r
        assert (p[0] == tokenizer.bos_token_id) if bos else tokenizer.bos_token_id is None
        assert c[-1] == r[-1] == tokenizer.eos_token_id


def test_a_pair_trl_would_refuse_is_refused(tok):
    """An empty message prompt, which TRL's chat rendering cannot end (it raises), is refused by the data screen."""
    record = {"prompt": [], "chosen": CHAT[0]["chosen"], "rejected": CHAT[0]["rejected"]}
    key, problem, _ = pair_problem(tok, record["prompt"], record["chosen"], record["rejected"], 96, "cpo")
    assert key == "data.prompt_field" and "a message prompt is empty" in problem


@pytest.mark.parametrize("pairs", ["dpo", "cpo"])
def test_message_records_without_a_chat_template_are_refused(tok, pairs):
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    with pytest.raises(PlanError) as info:
        pair_problem(bare, CHAT[0]["prompt"], CHAT[0]["chosen"], CHAT[0]["rejected"], 96, pairs)
    assert info.value.key == "data.chat_template" and "and the tokenizer has none" in str(info.value)


def _trl_stub(**kw):
    return SimpleNamespace(accelerator=SimpleNamespace(device="cpu"), **kw)


@pytest.mark.parametrize("loss_type,smoothing,alpha", [("sigmoid", 0.1, 0.0), ("hinge", 0.0, 0.0), ("ipo", 0.0, 0.0),
                                                       ("simpo", 0.2, 0.0), ("simpo", 0.0, 0.3)])
def test_cpo_pair_losses_are_trls(loss_type, smoothing, alpha):
    from trl.experimental.cpo import CPOTrainer

    torch.manual_seed(0)
    logps = -torch.rand(8, 2) * 3
    stub = _trl_stub(beta=0.7, loss_type=loss_type, label_smoothing=smoothing, simpo_gamma=0.4, alpha=alpha)
    want, chosen, rejected = CPOTrainer.cpo_loss(stub, logps[:, 0], logps[:, 1])
    assert torch.allclose(cpo_pair_loss(loss_type, 0.7, smoothing, 0.4, alpha, logps), want, rtol=1e-6)


def test_orpo_odds_ratio_is_trls():
    from trl.experimental.orpo import ORPOTrainer

    torch.manual_seed(0)
    logps = -torch.rand(8, 2) * 3
    losses, _, _, ratio, log_odds = ORPOTrainer.odds_ratio_loss(_trl_stub(beta=0.3), logps[:, 0], logps[:, 1])
    mine = (logps[:, 0] - logps[:, 1]) - (log1mexp(logps[:, 0]) - log1mexp(logps[:, 1]))
    assert torch.allclose(mine.mean(), log_odds) and torch.allclose(0.3 * torch.nn.functional.logsigmoid(mine), losses)


LOGITS_LABELS = (torch.tensor([[-100, 3, 4, -100, 5, 6, -100], [-100, -100, 1, -100, 2, -100, -100]]),
                 torch.tensor([[0, 0, 0, 1, 1, 1, -1], [0, 0, 0, 1, 1, -1, -1]]))


def _loss(objective: str, cfg) -> ReferenceFreeLoss:
    return ReferenceFreeLoss(VocabParallelLoss(11, TPContext()), objective, cfg)


def test_simpo_uses_per_token_means_and_no_nll():
    """SimPO's logps are each completion's mean log-probability; ``nll_loss`` is 0 as TRL logs it at cpo_alpha 0."""
    torch.manual_seed(1)
    logits = torch.randn(2, 7, 11)
    labels, segments = LOGITS_LABELS
    loss = _loss("cpo", CPOConfig(beta=2.0, loss_type="simpo", cpo_alpha=0.0))
    out = loss(logits, (labels, torch.tensor([1 / 2, 1 / 3]), segments, torch.zeros(2, 2), torch.arange(2)))
    lp = torch.log_softmax(logits, -1)
    logps = torch.stack([torch.stack([(lp[0, 1, 3] + lp[0, 2, 4]) / 2, (lp[0, 4, 5] + lp[0, 5, 6]) / 2]),
                         torch.stack([lp[1, 2, 1], lp[1, 4, 2]])])
    assert out.item() == pytest.approx(cpo_pair_loss("simpo", 2.0, 0.0, 0.5, 0.0, logps).mean().item(), rel=1e-6)
    metrics = loss.metrics(loss.take_stats("cpu"))
    assert metrics["nll_loss"] == 0.0 and metrics["logps/chosen"] == pytest.approx(logps[:, 0].mean().item(), rel=1e-6)
    assert metrics["rewards/margins"] == pytest.approx(2.0 * (logps[:, 0] - logps[:, 1]).mean().item(), rel=1e-6)


def _prepared(tmp_path, records, pairs: str):
    cfg = DataConfig(source="files", path=str(write_jsonl(tmp_path / "p.jsonl", records)), format="preference",
                     cache_dir=str(tmp_path / "cache"), seq_len=96)
    return prep.prepare(cfg, 0, log=lambda _: None, pairs=pairs)


def test_cpo_pairs_have_their_own_cache_and_rows(tok, tmp_path):
    """The rows hold CPO's tokens (each sequence its own prompt) in a cache folder of their own; DPO's is unchanged."""
    records = preference_pairs(8)
    dpo, cpo = _prepared(tmp_path, records, "dpo"), _prepared(tmp_path, records, "cpo")
    assert dpo.dir != cpo.dir
    samples = open_samples(json.loads(cpo.to_json()), "train", 0)
    for i, record in enumerate(records):
        p, c, q, r = cpo_sequences(tok, record["prompt"], record["chosen"], record["rejected"])
        ids, labels = (a[0] for a in samples.rows(np.array([i])))
        nc, nr = len(p) + len(c) - 1, len(q) + len(r) - 1
        assert list(ids[:nc + nr]) == (p + c)[:-1] + (q + r)[:-1]
        assert list(labels[:nc]) == [-100] * (len(p) - 1) + c and list(labels[nc:nc + nr]) == [-100] * (len(q) - 1) + r


def test_orpo_samples_label_the_chosen_prompt(tok, tmp_path):
    """ORPO's NLL runs over the whole chosen sequence: with ``prompt_nll`` the chosen prompt's tokens get the next
    token as label and segment 2 (the rejected prompt keeps none), and the per-token weight counts them."""
    from hybridtrain.parallel.dims import BatchLayout

    samples = open_samples(json.loads(_prepared(tmp_path, CHAT, "cpo").to_json()), "train", 0)
    layout = BatchLayout(2, 2, 1)
    plain = next(samples._tensors(np.arange(2), layout, 0, True))[1]
    samples.prompt_nll = True
    (inputs, _), (labels, weights, segments, _, _) = next(samples._tensors(np.arange(2), layout, 0, True))
    for k in range(2):
        n = int(samples.chosen_len[k])
        assert labels[k, :n - 1].tolist() == inputs[k, 1:n].tolist() and (segments[k, :n] >= 0).all()
        prompt = plain[0][k, :n] == -100
        assert (segments[k, :n][prompt] == 2).all() and (segments[k, :n][~prompt] == 0).all()
        assert torch.equal(labels[k, n:], plain[0][k, n:]) and torch.equal(segments[k, n:], plain[2][k, n:])
    assert weights[1].item() == pytest.approx(1 / samples.chosen_len[:2].sum()) and plain[1][1] > weights[1]


def test_orpo_loss_is_nll_over_the_chosen_sequence_minus_beta_log_sigmoid_odds():
    torch.manual_seed(2)
    logits = torch.randn(2, 7, 11)
    labels, segments = (t.clone() for t in LOGITS_LABELS)
    labels[0, 0], segments[0, 0] = 7, 2  # a chosen prompt token with its label
    loss = _loss("orpo", ORPOConfig(beta=0.3))
    out = loss(logits, (labels, torch.tensor([1 / 2, 1 / 4]), segments, torch.zeros(2, 2), torch.arange(2)))
    lp = torch.log_softmax(logits, -1)
    chosen = torch.stack([(lp[0, 1, 3] + lp[0, 2, 4]) / 2, lp[1, 2, 1]])
    rejected = torch.stack([(lp[0, 4, 5] + lp[0, 5, 6]) / 2, lp[1, 4, 2]])
    nll = -(lp[0, 0, 7] + lp[0, 1, 3] + lp[0, 2, 4] + lp[1, 2, 1]) / 4
    odds = (chosen - rejected) - (torch.log1p(-chosen.exp()) - torch.log1p(-rejected.exp()))
    want = nll - 0.3 * torch.nn.functional.logsigmoid(odds).mean()
    assert out.item() == pytest.approx(want.item(), rel=1e-5)
    metrics = loss.metrics(loss.take_stats("cpu"))
    assert metrics["nll_loss"] == pytest.approx(nll.item(), rel=1e-5)
    assert metrics["log_odds_chosen"] == pytest.approx(odds.mean().item(), rel=1e-5)


PAIRS = ("data.format=preference",)


@pytest.mark.parametrize("overrides,key,fragment", [
    pytest.param(("finetune.objective=cpo",), "finetune.objective",
                 "cpo trains on preference pairs, but data.format=text", id="cpo_without_pairs"),
    pytest.param(PAIRS + ("finetune.objective=cpo", "finetune.dpo.beta=0.2"), "finetune.dpo.beta",
                 "finetune.objective=cpo does not read finetune.dpo", id="dpo_key_under_cpo"),
    pytest.param(PAIRS + ("finetune.objective=orpo", "finetune.dpo.loss_type=[ipo]"), "finetune.dpo.loss_type",
                 "finetune.objective=orpo does not read finetune.dpo", id="dpo_key_under_orpo"),
    pytest.param(PAIRS + ("finetune.objective=dpo", "finetune.cpo.cpo_alpha=0"), "finetune.cpo.cpo_alpha",
                 "finetune.objective=dpo does not read finetune.cpo", id="cpo_key_under_dpo"),
    pytest.param(PAIRS + ("finetune.objective=cpo", "finetune.cpo.loss_type=robust"), "finetune.cpo.loss_type",
                 "is not a TRL CPO loss type", id="cpo_loss_type"),
    pytest.param(PAIRS + ("finetune.objective=cpo", "finetune.cpo.loss_type=hinge", "finetune.cpo.label_smoothing=0.1"),
                 "finetune.cpo.label_smoothing", "takes no label smoothing", id="cpo_smoothing"),
    pytest.param(PAIRS + ("finetune.objective=cpo", "finetune.cpo.simpo_gamma=1.0"), "finetune.cpo.simpo_gamma",
                 "is read only by loss_type=simpo", id="simpo_gamma_without_simpo"),
    pytest.param(PAIRS + ("finetune.objective=cpo", "finetune.cpo.beta=0"), "finetune.cpo.beta", "must be > 0",
                 id="cpo_beta"),
    pytest.param(PAIRS + ("finetune.objective=orpo", "finetune.orpo.beta=-1"), "finetune.orpo.beta", "must be > 0",
                 id="orpo_beta"),
    pytest.param(PAIRS + ("finetune.objective=orpo", "data.val_fraction=0.1"), "data.val_fraction",
                 "validation of finetune.objective=orpo is not supported yet", id="orpo_validation"),
])
def test_the_plan_refuses_what_cpo_and_orpo_cannot_run(overrides, key, fragment):
    with pytest.raises(PlanError) as info:
        resolve(compose("+recipe=gpt_tiny", *overrides), machine_facts())
    assert info.value.key == key and fragment in str(info.value)


@pytest.mark.parametrize("objective", ["cpo", "orpo"])
def test_reference_free_objectives_plan(objective):
    plan, _ = resolve(compose("+recipe=dpo", f"finetune.objective={objective}"), machine_facts())
    assert plan.global_batch_size == 8
