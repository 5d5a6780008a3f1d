"""Record formats -> samples (``hybridtrain.data.formats``): which labels carry loss, token by token."""
from __future__ import annotations

import pytest

from hybridtrain.config import DataConfig
from hybridtrain.data import formats
from hybridtrain.data.formats import IGNORE, to_row
from hybridtrain.data.tokenizer import EMBEDDED_CHAT_TEMPLATE, load_tokenizer
from hybridtrain.plan import PlanError


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DataConfig())


def test_to_row_shifts_pads_and_masks():
    inputs, labels = to_row([10, 11, 12, 13], [1, 1, 1, 1], seq_len=6, pad_id=0)
    assert inputs == [10, 11, 12, 0, 0, 0]
    assert labels == [11, 12, 13, IGNORE, IGNORE, IGNORE]
    # a target mask: label t is token t+1 only where token t+1 is a target
    inputs, labels = to_row([1, 2, 3, 4, 5], [0, 0, 1, 1, 0], seq_len=4, pad_id=9)
    assert inputs == [1, 2, 3, 4] and labels == [IGNORE, 3, 4, IGNORE]


def test_to_row_truncates_to_seq_len_plus_one_token():
    inputs, labels = to_row(list(range(100, 110)), [1] * 10, seq_len=3, pad_id=0)
    assert inputs == [100, 101, 102] and labels == [101, 102, 103]


def test_to_row_without_targets_is_dropped():
    assert to_row([1, 2, 3], [1, 0, 0], seq_len=4, pad_id=0) is None  # the first token is never a label
    assert to_row([5], [1], seq_len=4, pad_id=0) is None
    assert to_row([1, 2, 3, 4], [0, 0, 0, 1], seq_len=2, pad_id=0) is None  # the target is past seq_len


def test_packed_text_appends_eos_and_skips_empty_documents(tok):
    out = formats.text_stream({"t": ["In the beginning", "", "God"]}, [0, 1, 2], tokenizer=tok,
                              field="t", eos_id=tok.eos_token_id)
    assert out["ids"] == [tok("In the beginning")["input_ids"] + [tok.eos_token_id],
                          tok("God")["input_ids"] + [tok.eos_token_id]]
    with pytest.raises(PlanError) as info:  # a missing field is not an empty document (prepare screens it first)
        formats.text_stream({"t": ["In the beginning", None]}, [0, 1], tokenizer=tok, field="t", eos_id=0)
    assert "record 1" in str(info.value) and "NoneType, not text" in str(info.value)


def test_unpacked_text_every_real_token_is_a_target(tok):
    doc = "In the beginning God created the heaven and the earth."
    ids = tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    seq = len(ids) + 3
    out = formats.text_rows({"t": [doc]}, [0], tokenizer=tok, field="t", eos_id=tok.eos_token_id, seq_len=seq, pad_id=7)
    (inputs,), (labels,) = out["input_ids"], out["labels"]
    assert inputs == ids[:-1] + [7] * 4  # right padding
    assert labels == ids[1:] + [IGNORE] * 4  # padding carries no loss; EOS is learned
    # truncated to seq_len
    out = formats.text_rows({"t": [doc]}, [0], tokenizer=tok, field="t", eos_id=tok.eos_token_id, seq_len=4, pad_id=7)
    assert out["input_ids"] == [ids[:4]] and out["labels"] == [ids[1:5]]


def test_text_field_must_hold_text(tok):
    with pytest.raises(PlanError) as info:
        formats.text_rows({"t": ["ok", 17]}, [4, 5], tokenizer=tok, field="t", eos_id=0, seq_len=8, pad_id=0)
    assert info.value.key == "data.text_field" and "record 5" in str(info.value) and "int" in str(info.value)


def test_prompt_completion_loss_only_on_completion(tok):
    prompt, completion = "Who begat Enos?\n", "Seth begat Enos."
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    c = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    seq = len(p) + len(c) + 2
    out = formats.prompt_completion_rows({"q": [prompt], "a": [completion]}, [0], tokenizer=tok, prompt_field="q",
                                         completion_field="a", eos_id=tok.eos_token_id, seq_len=seq, pad_id=0)
    (inputs,), (labels,) = out["input_ids"], out["labels"]
    assert inputs == (p + c)[:-1] + [0] * 3
    expected = [IGNORE] * (len(p) - 1) + c + [IGNORE] * 3
    assert labels == expected
    for t, label in enumerate(labels):  # token by token: a label is the next input exactly where it counts
        if label != IGNORE:
            assert t >= len(p) - 1 and label == (p + c)[t + 1]


def test_prompt_completion_with_the_prompt_filling_seq_len_is_dropped(tok):
    out = formats.prompt_completion_rows({"q": ["word " * 40], "a": ["x"]}, [0], tokenizer=tok, prompt_field="q",
                                         completion_field="a", eos_id=0, seq_len=8, pad_id=0)
    assert all(column == [] for column in out.values()) and "input_ids" in out


def _assistant_char_spans(messages) -> tuple[str, list[tuple[int, int]]]:
    """The embedded template rendered by hand, and the character spans of assistant content + EOS."""
    text, spans = "", []
    for m in messages:
        if m["role"] == "assistant":
            text += "<|assistant|>\n"
            start = len(text)
            text += m["content"] + "<|endoftext|>"
            spans.append((start, len(text)))
        else:
            text += f"<|{m['role']}|>\n{m['content']}\n"
    return text, spans


def test_chat_loss_only_on_assistant_tokens(tok):
    messages = [{"role": "system", "content": "You recite scripture."},
                {"role": "user", "content": "Who begat Enos?"},
                {"role": "assistant", "content": "Seth begat Enos."},
                {"role": "user", "content": "And then?"},
                {"role": "assistant", "content": "Enos begat Cainan."}]
    out = formats.chat_rows({"m": [messages]}, [0], tokenizer=tok, field="m", seq_len=96, pad_id=0)
    (inputs,), (labels,) = out["input_ids"], out["labels"]

    # oracle, independent of the template machinery: character offsets of the hand-rendered text
    text, spans = _assistant_char_spans(messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    is_target = [any(s <= a and b <= e for s, e in spans) for a, b in enc["offset_mapping"]]
    assert inputs[:len(ids) - 1] == ids[:-1]
    for t in range(96):
        want = ids[t + 1] if t + 1 < len(ids) and is_target[t + 1] else IGNORE
        assert labels[t] == want, (t, labels[t], want, tok.decode(ids[max(0, t - 3):t + 2]))
    learned = tok.decode([l for l in labels if l != IGNORE])
    assert learned == "Seth begat Enos.<|endoftext|>Enos begat Cainan.<|endoftext|>"


def test_chat_template_without_generation_markers_is_refused(tmp_path):
    from hybridtrain.data.prepare import _map_fn

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    tok = load_tokenizer(DataConfig())
    tok.chat_template = template.read_text()
    with pytest.raises(PlanError) as info:
        _map_fn(DataConfig(format="chat"), tok)
    assert info.value.key == "data.chat_template" and "{% generation %}" in str(info.value)
    tok.chat_template = EMBEDDED_CHAT_TEMPLATE
    assert _map_fn(DataConfig(format="chat"), tok)[0] is formats.chat_rows


@pytest.mark.parametrize("messages, fragment", [
    ([{"role": "user", "content": "hi"}], "no assistant message"),
    ([{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}], "lacks a known role"),
    ([{"role": "assistant", "content": None}], "string content"),
    ("just text", "is str"),
    ([], "is list"),
])
def test_chat_records_need_the_expected_roles(messages, fragment):
    with pytest.raises(PlanError) as info:
        formats.check_messages(messages, 3, "messages")
    assert info.value.key == "data.messages_field" and "record 3" in str(info.value) and fragment in str(info.value)
