"""``data.format=preference``: records ``prompt``, ``chosen``, ``rejected`` -> one row per pair.

The records are TRL's standard preference form: plain text, or lists of ``{role, content}`` messages
rendered with the tokenizer's chat template (the prompt with the generation prompt). Each pair is tokenized
exactly as TRL 1.16's ``DPOTrainer`` does (``_prepare_dataset``): text completions get the EOS token
appended unless they end with it; the prompt and ``prompt + completion`` are tokenized separately
(text with the tokenizer's own special tokens, as ``tokenizer(text)``) and the completion starts where
the two diverge (``common_prefix_length``), so tokens that merge across the boundary land in the completion.

A pair becomes one row of ``seq_len`` tokens: the chosen sequence (prompt + chosen) as one document, the
rejected sequence (prompt + rejected) as a second, then padding; position ids restart at each
(:func:`~hybridtrain.data.packing.row_positions`), so a token attends only to its own sequence, and
the prompt tokens carry no loss. One pair per row means a micro-batch always holds whole pairs and
every layout sees the same pairs in the same order (a sample index is a pair). ``chosen_len`` (the
chosen document's tokens in the row) tells the loss which document a token belongs to.

A pair that does not fit (``(len(prompt + chosen) - 1) + (len(prompt + rejected) - 1) > seq_len``: each
document is its tokens but the last, whose next token does not exist) or whose completion tokenizes to
nothing is refused by :func:`screen`, naming the file and record, or counted with ``data.skip_invalid``.

``finetune.objective=reward`` takes the same records as whole sequences instead (``pairs="scored"``,
:func:`scored_rows`): a reward model reads every token of ``prompt + chosen`` (TRL's ``RewardTrainer``
tokenizes exactly ``prompt + chosen``, EOS appended to text, the same ids as above) and scores it at its last
token that is not the pad token (transformers' ``...ForSequenceClassification``); such a pair takes
``len(prompt + chosen) + len(prompt + rejected)`` tokens of its row.

The reference-free objectives (``finetune.objective=cpo`` / ``orpo``) tokenize as their TRL trainers do
(``pairs="cpo"``, :func:`cpo_sequences`: ``CPOTrainer.tokenize_row``, which ``ORPOTrainer`` shares), not as
``DPOTrainer``: messages are first rendered to text (``maybe_apply_chat_template``); the text is tokenized
without special tokens, the BOS token prepended and the EOS token appended where missing; each sequence keeps
its own prompt length (they may differ by the one token merged across the boundary).
"""
from __future__ import annotations

from typing import Any, Sequence

from hybridtrain.config.schema import DataConfig
from hybridtrain.data.formats import IGNORE, to_record
from hybridtrain.data.invalid import where
from hybridtrain.errors import PlanError


def conversational(value: Any) -> bool:
    """Whether a field holds messages (TRL's ``is_conversational``: a list of dicts with a role)."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def common_prefix_length(ids: Sequence[int], other: Sequence[int]) -> int:
    """Leading tokens ``ids`` and ``other`` share (TRL's ``common_prefix_length``)."""
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n


def _messages(value: list) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in value]


def pair_ids(tokenizer, prompt: Any, chosen: Any, rejected: Any) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, chosen_ids, rejected_ids)`` of one record, as TRL's ``DPOTrainer`` tokenizes it."""
    if conversational(prompt) or conversational(chosen):
        def render(messages: list, **kwargs) -> list[int]:
            out = tokenizer.apply_chat_template(_messages(messages), tokenize=True, return_dict=True, **kwargs)
            return list(out["input_ids"])

        prompt_ids = render(prompt, add_generation_prompt=True)
        with_chosen, with_rejected = render(prompt + chosen), render(prompt + rejected)
    else:
        eos = tokenizer.eos_token
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        prompt_ids = list(tokenizer(text=prompt)["input_ids"])
        with_chosen = list(tokenizer(text=prompt + chosen)["input_ids"])
        with_rejected = list(tokenizer(text=prompt + rejected)["input_ids"])
    n = min(common_prefix_length(prompt_ids, with_chosen), common_prefix_length(prompt_ids, with_rejected))
    return prompt_ids[:n], with_chosen[n:], with_rejected[n:]


PAIRS = ("dpo", "cpo", "scored")
"""How pairs are tokenized: ``dpo`` as ``DPOTrainer._prepare_dataset`` (:func:`pair_ids`), ``cpo`` as
``CPOTrainer.tokenize_row`` and ``ORPOTrainer.tokenize_row`` (:func:`cpo_sequences`), ``scored`` as
``RewardTrainer`` (``dpo``'s ids, each sequence whole, :func:`scored_rows`)."""


def tokenization_of(objective: Any) -> str:
    """The :data:`PAIRS` entry of ``finetune.objective``: ``cpo`` for ``cpo`` and ``orpo``, ``scored`` for
    ``reward``, else ``dpo``."""
    return {"cpo": "cpo", "orpo": "cpo", "reward": "scored"}.get(str(objective), "dpo")


class Untokenizable(ValueError):
    """A record TRL's ``CPOTrainer`` / ``ORPOTrainer`` would refuse while tokenizing (the message says why)."""


def _render_as_text(tokenizer, prompt: list, chosen: list, rejected: list) -> tuple[str, str, str]:
    """TRL's ``apply_chat_template`` of a conversational pair: the prompt (with the generation prompt after a
    user or tool turn, continuing a final assistant turn) cut to its common prefix with both renderings of
    prompt + completion, and each completion the rest of its rendering."""
    from itertools import takewhile

    if not prompt:
        raise Untokenizable("a message prompt is empty (TRL's chat rendering needs a last turn)")
    last = prompt[-1]["role"]
    if last not in ("user", "tool", "assistant"):
        raise Untokenizable(f"the prompt's last message has role {last!r} (TRL renders after user, tool or assistant)")
    kwargs = {"add_generation_prompt": last != "assistant", "continue_final_message": last == "assistant"}
    text = tokenizer.apply_chat_template(_messages(prompt), tokenize=False, **kwargs)
    with_chosen = tokenizer.apply_chat_template(_messages(prompt + chosen), tokenize=False)
    with_rejected = tokenizer.apply_chat_template(_messages(prompt + rejected), tokenize=False)
    for whole in (with_chosen, with_rejected):
        text = "".join(a for a, _ in takewhile(lambda ab: ab[0] == ab[1], zip(text, whole)))
    return text, with_chosen[len(text):], with_rejected[len(text):]


def _split_answer(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """TRL's ``build_tokenized_answer``: ``prompt + answer`` tokenized whole, cut where the prompt's own tokens
    end (one token earlier when the last prompt token merged across the boundary)."""
    whole = list(tokenizer(prompt + answer, add_special_tokens=False)["input_ids"])
    prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if len(prompt_ids) > len(whole):
        raise Untokenizable("the prompt tokenizes to more tokens than prompt + completion")
    start = len(prompt_ids) - (prompt_ids != whole[:len(prompt_ids)])
    return whole[:start], whole[start:]


def cpo_sequences(tokenizer, prompt: Any, chosen: Any,
                  rejected: Any) -> tuple[list[int], list[int], list[int], list[int]]:
    """``(chosen_prompt, chosen, rejected_prompt, rejected)`` token ids of one record, as TRL 1.16's
    ``CPOTrainer.tokenize_row`` (and ``ORPOTrainer``'s, the same function) makes them with no truncation;
    :class:`Untokenizable` where TRL raises."""
    if conversational(prompt) or conversational(chosen):
        prompt, chosen, rejected = _render_as_text(tokenizer, prompt, chosen, rejected)
    chosen_prompt, chosen_ids = _split_answer(tokenizer, prompt, chosen)
    rejected_prompt, rejected_ids = _split_answer(tokenizer, prompt, rejected)
    if (sum(a != b for a, b in zip(chosen_prompt, rejected_prompt)) > 1
            or abs(len(chosen_prompt) - len(rejected_prompt)) > 1):
        raise Untokenizable("the chosen and rejected sequences tokenize the prompt differently (TRL allows the "
                            "last token only)")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out = []
    for prompt_ids, answer in ((chosen_prompt, chosen_ids), (rejected_prompt, rejected_ids)):
        if bos is not None and (not prompt_ids or prompt_ids[0] != bos):
            prompt_ids = [bos] + prompt_ids
        if not answer or answer[-1] != eos:
            answer = answer + [eos]
        out += [prompt_ids, answer]
    return out[0], out[1], out[2], out[3]


def sequences(tokenizer, prompt: Any, chosen: Any, rejected: Any,
              pairs: str = "dpo") -> tuple[list[int], list[int], list[int], list[int]]:
    """``(chosen_prompt, chosen, rejected_prompt, rejected)`` token ids of one record, tokenized as ``pairs``
    (:data:`PAIRS`) says; under ``dpo`` both prompts are the same. Message records with a tokenizer that has
    no chat template: a :class:`PlanError`."""
    if (conversational(prompt) or conversational(chosen)) and not tokenizer.chat_template:
        raise PlanError("data.chat_template", "message records are rendered with a chat template, and the tokenizer "
                                              "has none; give data.chat_template=FILE (a Jinja template), or use a "
                                              "tokenizer that has one")
    if pairs == "cpo":
        return cpo_sequences(tokenizer, prompt, chosen, rejected)
    p, c, r = pair_ids(tokenizer, prompt, chosen, rejected)
    return p, c, p, r


def _documents(prompt_ids: list[int], completion_ids: list[int]) -> tuple[list[int], list[int]] | None:
    """One sequence's ``(inputs, labels)``: its tokens but the last; labels the next token where it is
    a completion token (:func:`~hybridtrain.data.formats.to_record` with room for the whole sequence)."""
    ids = prompt_ids + completion_ids
    return to_record(ids, [0] * len(prompt_ids) + [1] * len(completion_ids), max(1, len(ids) - 1))


def _mixed(prompt: Any, chosen: Any, rejected: Any) -> bool:
    """Whether the three fields are not all text or all messages (an empty prompt list counts as messages)."""
    kinds = {conversational(prompt) or (isinstance(prompt, list) and not prompt), conversational(chosen),
             conversational(rejected)}
    return len(kinds) > 1


def pair_tokens(prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int],
                rejected_prompt: list[int] | None = None) -> int:
    """Tokens a pair takes in its row: each sequence but its last token (``rejected_prompt``: the rejected
    sequence's own prompt, where it differs)."""
    other = prompt_ids if rejected_prompt is None else rejected_prompt
    return len(prompt_ids) + len(chosen_ids) - 1 + len(other) + len(rejected_ids) - 1


def pair_problem(tokenizer, prompt: Any, chosen: Any, rejected: Any, seq_len: int,
                 pairs: str = "dpo") -> tuple[str, str, int] | None:
    """``(key, problem, tokens)`` that keeps a record (whose fields passed :mod:`hybridtrain.data.invalid`)
    from training, or ``None``; tokenized as ``pairs`` (:data:`PAIRS`) says."""
    if _mixed(prompt, chosen, rejected):
        return "data.prompt_field", "prompt, chosen and rejected mix text and message lists", 0
    try:
        p, c, q, r = sequences(tokenizer, prompt, chosen, rejected, pairs)
    except Untokenizable as err:
        return "data.prompt_field", str(err), 0
    if not c or not r:
        return "data.chosen_field", "a completion tokenizes to no token", 0
    whole = pairs == "scored"  # scored_rows: every token of both sequences, nothing predicted
    if not whole and (_documents(p, c) is None or _documents(q, r) is None):  # nothing predicts the first token
        return "data.chosen_field", "a completion leaves no token to learn from (an empty prompt, one token)", 0
    tokens = len(p) + len(c) + len(q) + len(r) if whole else pair_tokens(p, c, r, q)
    if tokens > seq_len:
        return "data.seq_len", f"the pair is longer than data.seq_len={seq_len} tokens", tokens
    return None


def _problems(batch: dict[str, list], indices: list[int], *, tokenizer, fields: tuple[str, str, str],
              seq_len: int, pairs: str = "dpo") -> dict[str, list]:
    out: dict[str, list] = {"key": [], "problem": [], "tokens": []}
    for k in range(len(indices)):
        found = pair_problem(tokenizer, *(batch[f][k] for f in fields), seq_len, pairs) or ("", "", 0)
        for name, value in zip(out, found):
            out[name].append(value)
    return out


def fields(cfg: DataConfig) -> tuple[str, str, str]:
    """The prompt, chosen and rejected field names."""
    return cfg.prompt_field, cfg.chosen_field, cfg.rejected_field


def screen(ds, origins: Sequence[tuple[str, int]], cfg: DataConfig, tokenizer, source: str, pairs: str = "dpo"):
    """``ds`` less the pairs that cannot train (:func:`pair_problem`) and what was skipped (``{}``: none),
    as :func:`hybridtrain.data.invalid.screen` does for the field checks: without ``data.skip_invalid`` a
    :class:`PlanError` naming the key, the files and the record numbers. Tokenizes every pair (the rows are
    tokenized again after the validation split: the records' numbers in their files are known only here)."""
    found = ds.map(_problems, batched=True, with_indices=True, remove_columns=ds.column_names,
                   fn_kwargs={"tokenizer": tokenizer, "fields": fields(cfg), "seq_len": cfg.seq_len, "pairs": pairs},
                   num_proc=cfg.num_proc if cfg.num_proc > 1 else None, desc=f"checking {source} pairs")
    keys, problems, tokens = found["key"], found["problem"], found["tokens"]
    records = [i for i, p in enumerate(problems) if p]
    if not records:
        return ds, {}
    reasons: dict[str, int] = {}
    for r in records:
        reasons[problems[r]] = reasons.get(problems[r], 0) + 1
    why = "; ".join(f"{n}: {reason}" for reason, n in reasons.items())
    where_ = where(records, origins)
    if not cfg.skip_invalid:
        first = records[0]
        longest = max(tokens[r] for r in records)
        fix = (f"raise data.seq_len (the longest such pair takes {longest} tokens) or shorten the records"
               if keys[first] == "data.seq_len" else "fix or remove them")
        raise PlanError(keys[first], f"{len(records)} of {len(ds)} {source} preference records cannot be trained "
                                     f"on ({why}): {where_}; {fix}, or set data.skip_invalid=true to skip them "
                                     "(counted on the console and in data.json)")
    if len(records) == len(ds):
        raise PlanError("data.skip_invalid", f"every one of the {len(ds)} {source} preference records is invalid "
                                             f"({why}): {where_}; check data.seq_len and the field names")
    bad = set(records)
    kept = ds.select([i for i in range(len(ds)) if i not in bad])
    return kept, {"records": len(records), "of": len(ds), "why": why, "where": where_}


def merge_skipped(first: dict, second: dict) -> dict:
    """One source's ``skipped`` entry of two screens run one after the other (the second's ``of`` counts
    what the first kept)."""
    if not first or not second:
        return first or second
    return {"records": first["records"] + second["records"], "of": first["of"],
            "why": f"{first['why']}; {second['why']}", "where": f"{first['where']}; {second['where']}"}


def pair_rows(batch: dict[str, list], indices: list[int], *, tokenizer, fields: tuple[str, str, str],
              seq_len: int, pad_id: int, pairs: str = "dpo") -> dict[str, list]:
    """Batched ``datasets.map`` function: one row per pair (see the module), with ``num_labels`` (loss
    tokens of both sequences), ``chosen_len``, ``chosen_labels`` (the chosen sequence's loss tokens),
    ``pair_len`` (both documents' tokens), ``record`` and
    ``cut`` (always 0: :func:`screen` refused the pairs that do not fit)."""
    out: dict[str, list] = {"input_ids": [], "labels": [], "num_labels": [], "chosen_len": [], "chosen_labels": [],
                            "pair_len": [], "record": [], "cut": []}
    for k, index in enumerate(indices):
        p, c, q, r = sequences(tokenizer, *(batch[f][k] for f in fields), pairs)
        chosen, rejected = _documents(p, c), _documents(q, r)
        assert chosen is not None and rejected is not None, "screen() lets no empty completion through"
        inputs, labels = chosen[0] + rejected[0], chosen[1] + rejected[1]
        assert len(inputs) <= seq_len, "screen() lets no pair longer than seq_len through"
        pad = seq_len - len(inputs)
        out["input_ids"].append(inputs + [pad_id] * pad)
        out["labels"].append(labels + [IGNORE] * pad)
        out["num_labels"].append(sum(t != IGNORE for t in labels))
        out["chosen_len"].append(len(chosen[0]))
        out["chosen_labels"].append(sum(t != IGNORE for t in chosen[1]))
        out["pair_len"].append(len(inputs))
        out["record"].append(index)
        out["cut"].append(0)
    return out


def score_index(ids: Sequence[int], pad_id: int) -> int:
    """Where transformers' ``...ForSequenceClassification`` reads the score of the sequence ``ids`` (right-padded
    with ``pad_id``): its rightmost token that is not ``pad_id``, 0 if every one is (``(arange x non_pad).argmax()``).
    With the pad token the EOS token (TRL's default when the tokenizer has no pad token), that is the token
    before the EOS that ends a text completion."""
    return max((t for t, tok in enumerate(ids) if tok != pad_id), default=0)


def scored_rows(batch: dict[str, list], indices: list[int], *, tokenizer, fields: tuple[str, str, str],
                seq_len: int, pad_id: int) -> dict[str, list]:
    """Batched ``datasets.map`` function of ``finetune.objective=reward``: one row per pair, the whole chosen
    sequence (``prompt + chosen``, every token) then the whole rejected one, then ``pad_id``; ``labels`` are
    ``-100`` but at each sequence's :func:`score_index` (there: the token itself), which the reward loss reads.
    The columns of :func:`pair_rows` (``num_labels`` 2, ``chosen_labels`` 1)."""
    out: dict[str, list] = {"input_ids": [], "labels": [], "num_labels": [], "chosen_len": [], "chosen_labels": [],
                            "pair_len": [], "record": [], "cut": []}
    for k, index in enumerate(indices):
        p, c, r = pair_ids(tokenizer, *(batch[f][k] for f in fields))
        chosen, rejected = p + c, p + r
        inputs = chosen + rejected
        assert c and r and len(inputs) <= seq_len, "screen(pairs=\"scored\") lets no such pair through"
        labels = [IGNORE] * len(inputs)
        for at in (score_index(chosen, pad_id), len(chosen) + score_index(rejected, pad_id)):
            labels[at] = inputs[at]
        pad = seq_len - len(inputs)
        out["input_ids"].append(inputs + [pad_id] * pad)
        out["labels"].append(labels + [IGNORE] * pad)
        out["num_labels"].append(2)
        out["chosen_len"].append(len(chosen))
        out["chosen_labels"].append(1)
        out["pair_len"].append(len(inputs))
        out["record"].append(index)
        out["cut"].append(0)
    return out


def features(seq_len: int, dtype: str):
    """The Arrow schema of the pair rows."""
    from datasets import Features, List, Value

    return Features({"input_ids": List(Value(dtype), length=seq_len), "labels": List(Value("int32"), length=seq_len),
                     "num_labels": Value("int32"), "chosen_len": Value("int32"), "chosen_labels": Value("int32"),
                     "pair_len": Value("int32"),
                     "record": Value("int64"), "cut": Value("int32")})
