"""Chat mode with real chat templates (SmolLM2's from its GGUF, DeepSeek's, Llama-3's, Qwen3's)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from crosskd.alignment import REGIONS, SHAPE_NAMES, ChatOptions, align_chat, render, render_many
from crosskd.data.preparation import Preparation, prepare_rows
from crosskd.data.records import Record
from crosskd.errors import DataError
from crosskd.tokenization import load_tokenizer
from crosskd.zoo import train_tiny_bpe

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello. <|im_end|> Hello!"},
    {"role": "assistant", "content": "<think>A greeting.</think>Hello!"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You are welcome."},
]


def _view(tok, rendered, rng) -> bytes:
    return b"".join(tok.bytes.token_bytes(i) for i in rendered.tokens.ids[slice(*rng)])


@pytest.mark.parametrize(("student", "teacher"), [("smollm2", "deepseek-v3"), ("llama3", "qwen3")])
def test_assistant_content_reasoning_and_end_of_turn(zoo, student, teacher):
    s_tok, t_tok = zoo(student), zoo(teacher)
    aligned = align_chat(s_tok, t_tok, CONVERSATION, sample_id="conv-1")
    regions = [REGIONS[r] for r in aligned.chunk_region]
    assert set(regions) == {"reasoning", "close", "answer", "eot"}
    assert set(aligned.chunk_message.tolist()) == {2, 4}
    # Reasoning and answers align exactly; each assistant turn ends with an eot role pair.
    texts = {
        REGIONS[r]: b"".join(
            _view(s_tok, aligned.student, aligned.chunks.student[k])
            for k in np.flatnonzero((aligned.chunk_region == r) & (aligned.chunk_message == 2))
        )
        for r in (1, 3)
    }
    assert texts == {"reasoning": b"A greeting.", "answer": b"Hello!"}
    eot = np.flatnonzero(aligned.chunk_region == 4)
    assert len(eot) == 2 and (aligned.chunks.shape[eot] == SHAPE_NAMES.index("special")).all()
    for k in eot:
        s_id = aligned.student.tokens.ids[aligned.chunks.student[k, 0]]
        t_id = aligned.teacher.tokens.ids[aligned.chunks.teacher[k, 0]]
        assert s_tok.roles[int(s_id)] == t_tok.roles[int(t_id)] == "eot"
    answer = aligned.chunk_region == 3
    assert aligned.chunks.is_correct[answer].all() and aligned.kd_mask[answer].all()
    # The loss mask is exactly the assistant content (reasoning, close, answer) plus eot tokens.
    masked = b"".join(
        s_tok.bytes.token_bytes(i) for i in aligned.student.tokens.ids[aligned.loss_mask]
    )
    assert masked.startswith(b"A greeting.") and b"Hello!" in masked
    assert b"Say hello" not in masked and b"Be brief" not in masked and b"Thanks" not in masked
    assert masked.endswith(b"You are welcome." + s_tok.bytes.token_bytes(s_tok.role_ids["eot"]))


def test_user_typed_control_string_does_not_end_the_turn(zoo):
    smol = zoo("smollm2")
    rendered = render(smol, CONVERSATION, sample_id="conv-1")
    eot = smol.role_ids["eot"]
    user_start, user_end = next((a, b) for m, r, a, b in rendered.regions if m == 1)
    inside = (rendered.tokens.ends > user_start) & (rendered.tokens.ends <= user_end)
    assert eot not in rendered.tokens.ids[inside]
    assert "<|im_end|> Hello!" in rendered.text[user_start:user_end]


def test_content_repeated_elsewhere_is_located_by_message(zoo):
    llama, qwen = zoo("llama3"), zoo("qwen3")
    messages = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hello!"}]
    aligned = align_chat(llama, qwen, messages, sample_id="echo")
    _, _, a, b = next(r for r in aligned.student.regions if r[0] == 1)
    assert aligned.student.text[a:b] == "Hello!" and a > aligned.student.text.index("Hello!")
    assert set(aligned.chunk_message.tolist()) == {1}


def test_included_regions_and_drop_first_chunk(zoo):
    llama, qwen = zoo("llama3"), zoo("qwen3")
    full = align_chat(llama, qwen, CONVERSATION, sample_id="c")
    answer_only = align_chat(
        llama, qwen, CONVERSATION, sample_id="c", options=ChatOptions(included_regions=("answer",))
    )
    reasoning = answer_only.chunk_region == 1
    assert reasoning.any() and not answer_only.kd_mask[reasoning].any()
    assert answer_only.loss_mask.sum() < full.loss_mask.sum()
    dropped = align_chat(
        llama, qwen, CONVERSATION, sample_id="c", options=ChatOptions(drop_first_chunk=True)
    )
    first = [int(np.flatnonzero(dropped.chunk_message == m)[0]) for m in (2, 4)]
    assert not dropped.kd_mask[first].any()
    assert (dropped.kd_mask | np.isin(np.arange(len(dropped.kd_mask)), first) == full.kd_mask).all()


def _custom_template(tmp_path, template: str | None):
    folder = train_tiny_bpe(["hello world, how are you?"] * 50, 300, tmp_path / "tiny")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if template is None:
        config.pop("chat_template", None)
    else:
        config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return load_tokenizer(folder)


def test_message_that_cannot_be_located_names_sample_and_message(tmp_path, zoo):
    drops_users = (
        "{% for m in messages %}{% if m['role'] != 'user' %}{{ m['content'] }}{% endif %}"
        "{% endfor %}"
    )
    tok = _custom_template(tmp_path, drops_users)
    with pytest.raises(DataError, match=r"sample s-7: message 1 \(user\) cannot be located"):
        align_chat(zoo("llama3"), tok, CONVERSATION, sample_id="s-7")


def test_a_batch_names_its_first_conversation_that_cannot_be_rendered(tmp_path, zoo):
    """render_many encodes a batch's contents together and names the first conversation, in
    order, that its template cannot render; a prepared window renders in batches, and one
    that fails is rendered conversation by conversation, so the error is still the first bad
    record's, whichever check finds it."""
    drops_users = (
        "{% for m in messages %}{% if m['role'] != 'user' %}{{ m['content'] }}{% endif %}"
        "{% endfor %}"
    )
    tok = _custom_template(tmp_path, drops_users)
    answer_only = [{"role": "assistant", "content": "hello world"}]
    asked = [{"role": "user", "content": "how are you?"}, *answer_only]
    ids = ["a-0", "a-1", "u-2", "u-3"]
    with pytest.raises(DataError, match=r"sample u-2: message 0 \(user\) cannot be located"):
        render_many(tok, [answer_only, answer_only, asked, asked], sample_ids=ids)
    views = render_many(tok, [answer_only, answer_only], sample_ids=ids[:2])
    single = render(tok, answer_only, sample_id="a-0")
    assert [v.text for v in views] == [single.text] * 2
    assert all(np.array_equal(v.tokens.ids, single.tokens.ids) for v in views)
    preparation = Preparation.of(tok, [zoo("llama3")], [64, 64], ChatOptions())
    fine = Record("fine", None, answer_only, "data.jsonl", 1)
    user = Record("user", None, asked, "data.jsonl", 2)
    no_answer = Record("no-answer", None, [asked[0]], "data.jsonl", 3)
    with pytest.raises(DataError, match=r"sample user: message 0 \(user\) cannot be located"):
        prepare_rows([fine, user, no_answer], preparation)
    with pytest.raises(DataError, match="sample no-answer: the conversation has no assistant"):
        prepare_rows([fine, no_answer, user], preparation)


def test_tokenizer_without_template_gets_the_chatml_fallback(tmp_path, zoo):
    tok = _custom_template(tmp_path, None)
    rendered = render(tok, CONVERSATION[1:3], sample_id="s")
    assert rendered.fallback_template
    assert rendered.text.startswith("<|im_start|>user\nSay hello.")
    assert "<think>\nA greeting.\n</think>\n\nHello!<|im_end|>" in rendered.text


def test_conversation_without_assistant_is_refused(zoo):
    with pytest.raises(DataError, match="sample q: the conversation has no assistant message"):
        align_chat(zoo("llama3"), zoo("qwen3"), CONVERSATION[:2], sample_id="q")


def _qwen_with_template(tmp_path, zoo_cache, template: str):
    """The zoo's Qwen3 tokenizer with another chat template (a copy in ``tmp_path``)."""
    import shutil

    from crosskd.zoo import zoo_tokenizer_dir

    folder = tmp_path / "qwen-custom"
    shutil.copytree(zoo_tokenizer_dir("qwen3", zoo_cache), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(folder)


# Like the real Qwen3 template: reasoning only for assistant turns after the last user message,
# and a `</think>` written into the content is parsed out of it.
QWEN3_LIKE = (
    "{% set ns = namespace(last_user=0) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set content = m.content %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}{% set reasoning = content.split('</think>')[0]"
    ".split('<think>')[-1] %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{% if m.reasoning_content %}{% set reasoning = m.reasoning_content %}{% endif %}"
    "{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.role == 'assistant' and loop.index0 > ns.last_user and reasoning %}"
    "{{ '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ content + '<|im_end|>\\n' }}{% endfor %}"
)


def test_reasoning_a_template_drops_is_left_out_for_every_model(tmp_path, zoo, zoo_cache):
    teacher = _qwen_with_template(tmp_path, zoo_cache, QWEN3_LIKE)
    messages = [
        {"role": "user", "content": "One?"},
        {"role": "assistant", "content": "<think>Old thought.</think>One."},
        {"role": "user", "content": "Two?"},
        {"role": "assistant", "content": "<think>New thought.</think>Two."},
    ]
    aligned = align_chat(zoo("llama3"), teacher, messages, sample_id="multi")
    assert "Old thought" not in aligned.student.text and "Old thought" not in aligned.teacher.text
    assert "New thought" in aligned.student.text and "New thought" in aligned.teacher.text
    reasoning = aligned.chunk_message[aligned.chunk_region == REGIONS.index("reasoning")]
    assert set(reasoning.tolist()) == {3}


def test_eot_pairs_stay_within_their_turn_and_empty_answers_keep_theirs(tmp_path, zoo, zoo_cache):
    no_eot = _qwen_with_template(
        tmp_path,
        zoo_cache,
        (
            "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content }}"
            "{% if m.role != 'assistant' %}{{ '<|im_end|>\\n' }}{% else %}{{ '\\n' }}{% endif %}"
            "{% endfor %}"
        ),
    )
    roles = ["user", "assistant"] * 2
    messages = [{"role": r, "content": c} for r, c in zip(roles, "abcd", strict=True)]
    aligned = align_chat(zoo("llama3"), no_eot, messages, sample_id="no-eot")
    assert REGIONS.index("eot") not in aligned.chunk_region
    empty = [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]
    aligned = align_chat(zoo("llama3"), zoo("qwen3"), empty, sample_id="empty")
    assert aligned.chunk_region.tolist() == [REGIONS.index("eot")]
    assert aligned.loss_mask.sum() == 1 and aligned.kd_mask.all()
    clipped = align_chat(
        zoo("llama3"), zoo("qwen3"), CONVERSATION, sample_id="c", clipped_message=4
    )
    eot_owners = clipped.chunk_message[clipped.chunk_region == REGIONS.index("eot")]
    assert eot_owners.tolist() == [2]
    last_eot = int(np.flatnonzero(clipped.student.tokens.ids == 128009)[-1])
    assert not clipped.loss_mask[last_eot]


def test_drop_first_chunk_drops_the_first_counted_chunk(zoo):
    options = ChatOptions(included_regions=("answer",), drop_first_chunk=True)
    aligned = align_chat(zoo("llama3"), zoo("qwen3"), CONVERSATION, sample_id="c", options=options)
    for message in (2, 4):
        answer = np.flatnonzero(
            (aligned.chunk_message == message) & (aligned.chunk_region == REGIONS.index("answer"))
        )
        assert not aligned.kd_mask[answer[0]] and aligned.kd_mask[answer[1:]].all()


def test_unknown_region_is_refused(zoo):
    with pytest.raises(DataError, match=r"\['answers'\] are not regions"):
        align_chat(
            zoo("llama3"),
            zoo("qwen3"),
            CONVERSATION,
            sample_id="c",
            options=ChatOptions(included_regions=("answers",)),
        )
