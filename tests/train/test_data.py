"""Chat data: assistant-only loss masks (goldens per template), both row shapes, malformed rows."""

import json

import pytest

from tsengine.conversations import load_rows, normalize
from tsengine.train.data import Skipped, build, tokenize

LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Written by us to reproduce Qwen3's rendering of plain chats (not its template text): the assistant turn
# after the last user message gets an empty think block, earlier ones do not, so the rendering of a
# conversation is not a prefix of the rendering of its continuation.
QWEN3 = (
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m.content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the water"},
        {"role": "assistant", "content": "one number"}, {"role": "user", "content": "how long"},
        {"role": "assistant", "content": "two people"}]


def masked_text(tok, ex):
    """The trained-on tokens as maximal runs of text."""
    runs, cur = [], []
    for t, m in zip(ex.input_ids, ex.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur)), cur.clear()
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_chatml_golden(tiny_models):
    _, tok = tiny_models["llama"]
    ex = tokenize(tok, CHAT)
    assert masked_text(tok, ex) == ["one number<|im_end|>", "two people<|im_end|>"]
    assert tok.decode(ex.input_ids).startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user")


def test_llama3_golden(tiny_models):
    _, tok = tiny_models["qwen3"]
    tok = type(tok).from_pretrained(tok.name_or_path)  # a private copy we can give another template
    tok.add_special_tokens({"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>",
                                                          "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA3
    ex = tokenize(tok, CHAT)
    assert masked_text(tok, ex) == ["one number<|eot_id|>", "two people<|eot_id|>"]


def test_qwen3_golden_not_prefix_stable(tiny_models):
    _, tok = tiny_models["qwen3"]
    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.chat_template = QWEN3
    ex = tokenize(tok, CHAT)
    assert masked_text(tok, ex) == ["one number<|im_end|>", "two people<|im_end|>"]
    text = tok.decode(ex.input_ids)
    assert text.count("<think>") == 1 and "<think>\n\n</think>\n\ntwo people" in text


def test_repeated_text_masks_the_assistant_copy(tiny_models):
    _, tok = tiny_models["llama"]
    chat = [{"role": "user", "content": "one number"}, {"role": "assistant", "content": "one number"}]
    ex = tokenize(tok, chat)
    assert masked_text(tok, ex) == ["one number<|im_end|>"]
    first_masked = ex.loss_mask.index(1)
    assert "assistant" in tok.decode(ex.input_ids[:first_masked])


def test_reply_that_repeats_template_text_and_trailing_newline(tiny_models):
    _, tok = tiny_models["llama"]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "assistant"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "the water\n"}]
    ex = tokenize(tok, chat)
    runs = masked_text(tok, ex)
    assert runs[0] == "assistant<|im_end|>" and runs[1].startswith("the water") and runs[1].endswith("<|im_end|>")
    assert "<|im_start|>assistant\n" not in "".join(runs)


def test_template_that_raises_is_a_counted_skip(tiny_models):
    _, tok = tiny_models["qwen3"]
    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.chat_template = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
                         "{{ raise_exception('roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}")
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                          {"role": "assistant", "content": "c"}]}]
    kept, skipped = build(tok, rows)
    assert not kept and skipped.reasons == {"rejected by the chat template": 1}


@pytest.mark.real_model
def test_smollm2_golden(smollm2):
    _, _, tok = smollm2
    ex = tokenize(tok, CHAT[1:])  # no system turn: the template inserts SmolLM's default one
    assert masked_text(tok, ex) == ["one number<|im_end|>", "two people<|im_end|>"]
    assert "You are a helpful AI assistant named SmolLM" in tok.decode(ex.input_ids)


def test_both_shapes_normalize_alike():
    openai = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    assert normalize(openai) == normalize(sharegpt)


def test_malformed_rows_are_counted_not_fatal(tiny_models):
    _, tok = tiny_models["llama"]
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the water"}]}
    rows = [good,
            {"messages": [{"role": "user", "content": "hi"}]},
            {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]},
            {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]},
            {"text": "no chat"},
            {"messages": "not a list"},
            {"messages": [{"role": "user", "content": "hi " * 300}, {"role": "assistant", "content": "x"}]}]
    kept, skipped = build(tok, rows, max_length=64)
    assert len(kept) == 1
    assert skipped.reasons == {"no assistant turn": 1, "empty content": 1, "unknown role": 1,
                               "no messages/conversations": 1, "turns are not a list of objects": 1,
                               "over max length": 1}
    assert skipped.summary(1).startswith("1 rows kept, 6 skipped (")


def test_local_jsonl_and_parquet(tmp_path, tiny_models):
    import datasets

    _, tok = tiny_models["llama"]
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(3)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    for name in ("d.jsonl", "d.parquet"):
        kept, skipped = build(tok, load_rows(str(tmp_path / name)))
        assert len(kept) == 3 and not skipped.reasons, name
    assert Skipped().summary(0) == "0 rows kept, none skipped"
