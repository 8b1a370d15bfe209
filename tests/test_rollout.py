"""On-policy rows (:mod:`crosskd.data.rollout`): a student's answer to a prompt, prepared by
the rollout functions, is the sample ``crosskd prepare`` stores for the same conversation
(every column), with a Llama-3 student, a Qwen3 teacher and a same-tokenizer teacher; the loss
mask and the KD chunks cover the answer and its end-of-turn token only; the rows collate; a
long answer is clipped as prepare clips it; bad input is refused in one line naming the
sample. A text is continued as text: the rollout is the sample prepare stores for the whole
text, trained on the continuation only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from crosskd.alignment import ChatOptions
from crosskd.data.collate import collate, load_prepared
from crosskd.data.preparation import Preparation
from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.data.records import Record, read_records
from crosskd.data.rollout import (
    answer_text,
    continuation_text,
    continued,
    prompt_ids,
    rollout_prompt,
    rollout_samples,
    stop_ids,
)
from crosskd.data.shards import FLAG_KD
from crosskd.errors import ConfigError, DataError

TEACHERS = ["zoo:qwen3", "zoo:llama3"]  # a cross-tokenizer teacher and a same-tokenizer one
CONVERSATIONS = [
    {
        "id": "emoji",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour and a café e\u0301. <|eot_id|>"},
            {"role": "assistant", "content": " Blue 🎉, like a café e\u0301 awning. "},
        ],
    },
    {
        "id": "reasoning",
        "messages": [
            {"role": "user", "content": "What is 12 * 12?"},
            {"role": "assistant", "content": "<think>12 * 12 = 144.</think>It is 144."},
        ],
    },
]

ANSWERS = {
    "emoji": ("", "Blue 🎉, like a café \u00e9 awning."),
    "reasoning": ("<think>\n", "12 * 12 = 144.\n</think>\n\nIt is 144."),
}
"""Per conversation, the student's rendering of its answer: the template's text before the
first masked token, and the masked tokens before the end-of-turn token."""


def _prepared(folder: Path, rows: list[dict], max_length: int, **options) -> tuple[list, str]:
    """``crosskd prepare`` of ``rows`` (unpacked: one sample per packed row, ``bin`` its
    index) into ``folder``: its samples in order, and the data file."""
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    config = PrepareConfig(
        data=str(data),
        student_tokenizer="zoo:llama3",
        teacher_tokenizers=TEACHERS,
        output=str(folder / "out"),
        max_length=max_length,
        pack=False,
        **options,
    )
    prepare(config, progress=False)
    rows = list(load_prepared(config.output).packed_rows())
    assert all(len(row) == 1 for row in rows)
    return [row[0] for row in rows], str(data)


def _preparation(zoo, max_length: int, options: ChatOptions | None = None) -> Preparation:
    """The rollout side of :func:`_prepared` (the options: prepare's defaults unless given)."""
    teachers = [zoo(name.removeprefix("zoo:")) for name in TEACHERS]
    chat = options or ChatOptions()
    return Preparation.of(zoo("llama3"), teachers, [max_length] * 3, chat, same=[False, True])


def _rollouts(data: str, preparation: Preparation) -> tuple[list[Record], list[dict]]:
    """The data's conversations as rollouts (prompt, then the recorded answer) and their
    samples."""
    records = list(read_records(data))
    conversations = [continued(rollout_prompt(r), r.messages[-1]["content"]) for r in records]
    return conversations, rollout_samples(conversations, preparation)


def _assert_equal_samples(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert list(g) == list(w)  # the same columns, in the shard's order
        for column in w:
            assert g[column] == w[column], (w["sample_id"], column)
            assert type(g[column]) is type(w[column]), (w["sample_id"], column)


@pytest.fixture(scope="module")
def zoo_env(zoo_cache):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CROSSKD_CACHE_DIR", str(zoo_cache))
        yield


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, zoo_env, zoo):
    """The conversations through ``crosskd prepare`` and through the rollout functions."""
    want, data = _prepared(tmp_path_factory.mktemp("rollout"), CONVERSATIONS, 256)
    preparation = _preparation(zoo, 256)
    conversations, got = _rollouts(data, preparation)
    return {"want": want, "got": got, "conversations": conversations, "prep": preparation}


def test_rollout_samples_are_the_samples_prepare_stores(prepared):
    _assert_equal_samples(prepared["got"], prepared["want"])
    assert prepared["prep"].nfc and prepared["prep"].strip  # Qwen3's NFC, Llama-3's trim
    assert [s["clipped"] for s in prepared["got"]] == [False, False]


def test_loss_mask_and_kd_cover_the_answer_and_its_end_of_turn_only(prepared, zoo):
    student, qwen = zoo("llama3"), zoo("qwen3")
    for sample, conversation in zip(prepared["got"], prepared["conversations"], strict=True):
        ids = np.array(sample["student_ids"])
        masked = np.flatnonzero(sample["student_loss_mask"])
        # the prompt the sampler continued is the start of the stored student ids; then the
        # template's opening of the reasoning (not masked), then one masked run to the end:
        # the answer (NFC, stripped) and the end-of-turn token
        prompt = prompt_ids(rollout_prompt(conversation), prepared["prep"])
        assert ids[: len(prompt)].tolist() == prompt.tolist()
        opener, answer = ANSWERS[sample["sample_id"]]
        assert student.hf.decode(ids[len(prompt) : masked[0]]) == opener
        assert masked.tolist() == list(range(masked[0], len(ids)))
        assert ids[-1] == student.role_ids["eot"]
        assert student.hf.decode(ids[masked[:-1]]) == answer
        # Qwen3's KD chunks cover exactly the masked student tokens, and its answer + <|im_end|>
        flags = np.array(sample["teacher0_chunk_flags"])
        kd = np.flatnonzero(flags & FLAG_KD)
        s0, s1 = (np.array(sample[f"teacher0_chunk_{x}"])[kd] for x in ("s0", "s1"))
        covered = np.concatenate([np.arange(a, b) for a, b in zip(s0, s1, strict=True)])
        assert covered.tolist() == masked.tolist()
        t0, t1 = (np.array(sample[f"teacher0_chunk_{x}"])[kd] for x in ("t0", "t1"))
        t_ids = np.array(sample["teacher0_ids"])[t0[0] : t1[-1]]
        assert t_ids[-1] == qwen.role_ids["eot"]
        # the same-tokenizer teacher's KD positions are the masked tokens
        same = np.flatnonzero(np.array(sample["teacher1_chunk_flags"]) & FLAG_KD)
        assert same.tolist() == masked.tolist()


def test_rollout_rows_collate_with_prepared_rows(prepared):
    rows = [[s] for s in prepared["got"]] + [prepared["want"]]  # the last row packs two
    batch = collate(rows, n_teachers=2)
    masks = [sum(s["student_loss_mask"]) for s in prepared["got"]]
    assert batch.loss_mask.sum(dim=1).tolist() == [*masks, sum(masks)]
    assert not batch.chunks[0].same_tokenizer and batch.chunks[1].same_tokenizer
    valid = batch.chunks[1].valid
    assert valid.sum().item() == 2 * sum(masks)  # every answer token + end-of-turn, both copies
    assert batch.sample_ids == [["emoji"], ["reasoning"], ["emoji", "reasoning"]]


def test_sampled_ids_become_the_answer_text(zoo):
    student = zoo("llama3")
    stops = stop_ids(student)
    assert student.role_ids["eot"] in stops and student.role_ids["eos"] in stops
    ids = student.hf.encode(" Blue 🎉 sky.", add_special_tokens=False)
    special = student.role_ids["turn_start"]
    sampled = [*ids[:2], special, *ids[2:], student.role_ids["eot"], *ids]
    assert answer_text(student.hf, sampled, stops) == ("Blue 🎉 sky.", True)
    assert answer_text(student.hf, ids, stops) == ("Blue 🎉 sky.", False)


def test_a_long_answer_is_clipped_as_prepare_clips_it(tmp_path, zoo_env, zoo):
    long = {
        "id": "long",
        "messages": [
            {"role": "user", "content": "Count."},
            {"role": "assistant", "content": " ".join(str(i) for i in range(200))},
        ],
    }
    options = {"included_regions": ["answer"], "drop_first_chunk": True}
    want, data = _prepared(tmp_path, [long], 48, **options)
    preparation = _preparation(zoo, 48, ChatOptions(("answer",), True))
    _, got = _rollouts(data, preparation)
    _assert_equal_samples(got, want)
    sample = got[0]
    assert sample["clipped"] and sample["original_lengths"][0] > 48
    assert max(len(sample[f"{m}_ids"]) for m in ("student", "teacher0", "teacher1")) <= 48
    ids = np.array(sample["student_ids"])[np.array(sample["student_loss_mask"])]
    assert zoo("llama3").role_ids["eot"] not in ids.tolist()  # a cut answer has no end of turn
    assert long["messages"][1]["content"].startswith(zoo("llama3").hf.decode(ids))


TEXT = "Water boils at 100 degrees Celsius at sea level, and café e\u0301 sits in 12,345 cups."


def test_a_text_is_continued_as_text_and_trained_on_its_continuation_only(tmp_path, zoo_env, zoo):
    """A text record's prompt is its start, cut at a whitespace; the rollout (prompt + the
    student's continuation) is the sample prepare stores for the whole text, except that the CE
    targets and every teacher's KD chunks are the continuation's alone."""
    (want,), data = _prepared(tmp_path, [{"id": "text", "text": TEXT}], 256)
    (record,) = read_records(data)
    preparation = _preparation(zoo, 256)
    normal = preparation.normalized(record)  # NFC: the e + combining accent is one character
    prompt = rollout_prompt(normal, 0.5)
    # 0.5 of the 80 characters is 40, inside "sea": cut back to the space before it (37)
    assert len(normal.text) == 80 and prompt.text == "Water boils at 100 degrees Celsius at"
    student = zoo("llama3")
    ids = prompt_ids(prompt, preparation)
    assert ids.tolist() == student.hf.encode(prompt.text)  # its BOS, no end token
    answer = normal.text[len(prompt.text) :]
    (got,) = rollout_samples([continued(prompt, answer)], preparation, [len(prompt.text)])
    masks = ("student_loss_mask", "teacher0_chunk_flags", "teacher1_chunk_flags")
    for column in want:
        if column not in masks:
            assert got[column] == want[column], column
    masked = np.flatnonzero(got["student_loss_mask"])
    full = np.array(got["student_ids"])
    assert full[: len(ids)].tolist() == ids.tolist()
    assert masked.tolist() == list(range(len(ids), len(full)))  # the continuation, to its end
    assert (
        student.hf.decode(full[masked])
        == answer
        == " sea level, and café \u00e9 sits in 12,345 cups."
    )
    assert np.array(want["student_loss_mask"])[masked].all()  # prepare trains on all of it
    kd = np.flatnonzero(np.array(got["teacher0_chunk_flags"]) & FLAG_KD)
    s0, s1 = (np.array(got[f"teacher0_chunk_{x}"])[kd] for x in ("s0", "s1"))
    covered = np.concatenate([np.arange(a, b) for a, b in zip(s0, s1, strict=True)])
    assert covered.tolist() == masked.tolist()
    t0 = np.array(got["teacher0_chunk_t0"])[kd[0]]
    assert zoo("qwen3").hf.decode(got["teacher0_ids"][t0:]) == answer
    same = np.flatnonzero(np.array(got["teacher1_chunk_flags"]) & FLAG_KD)
    assert same.tolist() == masked.tolist()
    # what the sampler adds to a prompt's decoded text: not stripped, to its stop
    stops = stop_ids(student)
    sampled = [*student.hf.encode(" Celsius.", add_special_tokens=False), student.role_ids["eot"]]
    assert continuation_text(student.hf, ids.tolist(), [*sampled, 9], stops) == (" Celsius.", True)
    assert continuation_text(student.hf, ids.tolist(), sampled[:-1], stops) == (" Celsius.", False)


@pytest.mark.parametrize("text", ["a", "ab   ", ""])
def test_a_text_too_short_for_a_prompt_is_refused_naming_it(text):
    with pytest.raises(DataError, match=r"^sample bad-7 .*too short to give the student a prompt"):
        rollout_prompt(_record(None, text))


def test_a_text_prompt_ends_before_the_whole_run_of_whitespace():
    # 23 characters, 0.5 of them is 11: inside the indentation; the prompt ends before the
    # newline, so the answer starts with the newline and all of the indentation
    prompt = rollout_prompt(_record(None, "def f(x):\n    return x\n"))
    assert prompt.text == "def f(x):" and prompt.messages is None
    assert rollout_prompt(_record(None, "no_space_here"), 0.5).text == "no_spa"


def _record(messages: list[dict] | None, text: str | None = None) -> Record:
    return Record("bad-7", text, messages, "rollouts.jsonl", 7)


USER = {"role": "user", "content": "Hi?"}
ANSWER = {"role": "assistant", "content": "Hello."}


@pytest.mark.parametrize(
    ("conversation", "message"),
    [
        (_record([USER]), "has no assistant message"),
        (_record([USER, {"role": "assistant", "content": ""}]), "answer is empty"),
        (_record([USER, {"role": "assistant", "content": " \n "}]), "answer is empty"),
        (_record([USER, {"role": "assistant", "content": "<think></think>"}]), "answer is empty"),
        (_record([USER, ANSWER, USER, ANSWER]), "goes on after its first assistant message"),
        (_record([{"role": "system", "content": "Hi."}, ANSWER]), "has no user message"),
        (_record(None, "plain text"), "a text continuation without its answer's start"),
    ],
)
def test_bad_rollouts_are_refused_in_one_line_naming_the_sample(zoo, conversation, message):
    with pytest.raises(DataError, match=message) as raised:
        rollout_samples([conversation], _preparation(zoo, 256))
    text = str(raised.value)
    assert "\n" not in text and text.startswith("sample bad-7 (rollouts.jsonl, row 7)")


def test_prompts_and_preparations_refuse_bad_input(zoo):
    with pytest.raises(DataError, match=r"^sample bad-7 .*is a conversation but has an answer"):
        rollout_samples([_record([USER, ANSWER])], _preparation(zoo, 256), [3])
    with pytest.raises(DataError, match=r"^sample bad-7 .*has no user message") as raised:
        rollout_prompt(_record([{"role": "system", "content": "Hi."}]))
    assert "\n" not in str(raised.value)
    prompt = rollout_prompt(_record([USER, ANSWER, USER, ANSWER]))
    assert prompt.messages == [USER] and prompt.sample_id == "bad-7"
    with pytest.raises(ConfigError, match="disagree with the tokenizer fingerprints"):
        Preparation.of(zoo("llama3"), [zoo("qwen3")], [64, 64], ChatOptions(), same=[True])
    with pytest.raises(ConfigError, match="give one per model"):
        Preparation.of(zoo("llama3"), [zoo("qwen3")], [64], ChatOptions())
