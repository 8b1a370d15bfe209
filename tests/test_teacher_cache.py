"""Teacher scoring and the teacher cache with a tiny random-init Llama teacher: storage
round trips, resumable scoring on a real S3 server (moto on loopback), the reader's checks, and
the online signal."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crosskd.cli import main
from crosskd.data.collate import collate, load_prepared
from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.data.rows import PackedRows
from crosskd.errors import CrosskdError
from crosskd.teacher import signal_from_logits
from crosskd.teacher.cache import CacheError, open_cache
from crosskd.teacher.model import load_teacher
from crosskd.teacher.scoring import ScoreConfig, budget_batches, online_signal, score_all
from crosskd.teacher.sharded import score
from crosskd.teacher.signal import SignalError
from crosskd.teacher.storage import LOSSY_STEP, decode, encode, signal_samples
from crosskd.tokenization import load_tokenizer
from crosskd.train.order import ShardOrder
from crosskd.zoo import train_tiny_bpe
from crosskd.zoo.models import init_llama

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Pack my box with five dozen liquor jugs, 12 of them.",
    "Sphinx of black quartz, judge my vow!",
    "How vexingly quick daft zebras jump; 3.14159 and 2.71828.",
    "Über café naïve — ünïcödé text, 東京 and emoji 🎉 too.",
    "A short one.",
] * 3


@pytest.fixture(scope="module")
def tiny_teacher(tmp_path_factory):
    """A tiny Llama (random weights, seed 0) with a tiny byte-level BPE, as an HF folder."""
    folder = tmp_path_factory.mktemp("tiny-teacher")
    train_tiny_bpe(TEXTS * 5, 400, folder)
    return init_llama(folder, str(folder), {"hidden_size": 32, "intermediate_size": 64}, 0)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_teacher, zoo_cache):
    root = tmp_path_factory.mktemp("prepared")
    data = root / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"s{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS))
    )
    config = PrepareConfig(
        data=str(data),
        student_tokenizer="zoo:llama3",
        teacher_tokenizers=[str(tiny_teacher)],
        output=str(root / "out"),
        max_length=64,
        shard_rows=5,
    )
    prepare(config, progress=False)
    return config.output


def _score_config(prepared, tiny_teacher, output, **kw) -> ScoreConfig:
    return ScoreConfig(
        data=prepared, teacher=str(tiny_teacher), output=output, k=8, token_budget=64, **kw
    )


# --- storage ----------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    k=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_lossless_round_trip_is_exact_and_lossy_is_within_half_a_step(lengths, k, seed):
    gen = torch.Generator().manual_seed(seed)
    width, vocab = max(lengths), 40
    ids = torch.randint(0, vocab, (len(lengths), width), generator=gen)
    signal = signal_from_logits(
        torch.randn(len(lengths), width, vocab, generator=gen) * 4, ids, k=k, tau=1.5
    )
    samples = signal_samples(signal, lengths)
    names = [f"x{i}" for i in range(len(lengths))]
    lossless = decode(encode(names, samples, "lossless"), "lossless", k)
    lossy = decode(encode(names, samples, "lossy"), "lossy", k)
    for (name, exact), (_, approx), original in zip(lossless, lossy, samples, strict=True):
        assert name in names
        np.testing.assert_array_equal(exact.ids, original.ids)
        np.testing.assert_array_equal(exact.log_probs, original.log_probs)
        np.testing.assert_array_equal(exact.realized, original.realized)
        np.testing.assert_array_equal(exact.realized_t1, original.realized_t1)
        np.testing.assert_array_equal(approx.ids, original.ids)
        floor = original.log_probs.max(axis=1, keepdims=True) - 255 * LOSSY_STEP
        above = original.log_probs >= floor
        error = np.abs(approx.log_probs - original.log_probs)
        assert (error[above] <= LOSSY_STEP / 2 + 1e-5).all()
        assert (approx.log_probs[~above] >= original.log_probs[~above]).all()


def test_budget_batches_stay_within_the_budget():
    lengths = [5, 9, 3, 30, 9, 1]
    batches = budget_batches(lengths, 20)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 20
    assert batches[0] == [3]  # longer than the budget: alone


# --- scoring and reading, on S3 ------------------------------------------------------------


def test_score_to_s3_read_back_and_check(s3, prepared, tiny_teacher, tmp_path):
    uri = "s3://crosskd-test/cache/full"
    manifest = score(_score_config(prepared, tiny_teacher, uri), progress=False)
    data = load_prepared(prepared)
    assert [s["path"] for s in manifest["shards"]] == [s["path"] for s in data.manifest["shards"]]
    assert len(manifest["shards"]) >= 3 and manifest["samples"] == len(TEXTS)
    assert manifest["k"] == 8 and manifest["tau"] == 1.0 and manifest["encoding"] == "lossless"
    # Each shard's footer (its row groups' digests) is recorded: training reads by ranges.
    for entry in manifest["shards"]:
        offset, size = entry["footer"]["offset"], entry["footer"]["bytes"]
        assert offset + size == entry["bytes"]
        tail = s3.cat_file(f"crosskd-test/cache/full/{entry['path']}", start=offset)
        assert hashlib.sha256(tail).hexdigest() == entry["footer"]["sha256"]
    teacher = load_teacher(str(tiny_teacher))
    # Bits per byte, recomputed directly: every sample alone through the model, -log2 p of each
    # token after the first, over those tokens' UTF-8 bytes.
    lengths = load_tokenizer(str(tiny_teacher)).bytes.lengths
    bits = n_bytes = 0.0
    for row in data.packed_rows():
        for sample in row:
            ids = torch.tensor([sample["teacher0_ids"]])
            with torch.no_grad():
                lp = torch.log_softmax(teacher.model(input_ids=ids).logits.double(), -1)
            bits -= lp[0, :-1].gather(-1, ids[0, 1:, None]).sum().item() / math.log(2)
            n_bytes += lengths[ids[0, 1:].numpy()].sum()
    assert manifest["bits_per_byte"] == pytest.approx(bits / n_bytes, rel=1e-5)
    cache = open_cache(
        uri,
        teacher_fingerprint=teacher.fingerprint,
        k=8,
        tau=1.0,
        data_fingerprint=data.manifest["data_fingerprint"],
    )
    # Sequential and random access (by place in the prepared data) agree, and match a direct
    # forward of the sample.
    for index in range(len(manifest["shards"])):
        for row, (sample_id, sig) in reversed(list(enumerate(cache.shard(index)))):
            assert np.array_equal(cache.signal_at(index, row, sample_id).log_probs, sig.log_probs)
    assert all(n == 1 for n in cache.reads.values())  # each shard read once
    sample = data.shard_samples(1)[0]
    ids = torch.tensor([sample["teacher0_ids"]])
    with torch.no_grad():
        logits = teacher.model(input_ids=ids).logits
    direct = torch.log_softmax(logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    got = cache.signal_at(1, 0, sample["sample_id"])
    np.testing.assert_allclose(got.realized, direct.numpy(), rtol=1e-5, atol=1e-5)
    # Every field the training config may ask about is checked, naming it and both values.
    for kwargs, field in (
        ({"k": 16}, "k is 8, the config asks for 16"),
        ({"tau": 2.0}, "tau is 1.0, the config asks for 2.0"),
        ({"teacher_fingerprint": "abc"}, "teacher fingerprint is"),
        ({"tokenizer_fingerprint": "abc"}, "tokenizer fingerprint is"),
        ({"data_fingerprint": "abc"}, "data fingerprint is"),
    ):
        with pytest.raises(SignalError, match=field):
            open_cache(uri, **kwargs)
    with pytest.raises(
        CacheError,
        match=r"shard 1 row 0 holds '.*', the prepared data has "
        r"'nope' there; .*score the data you train on",
    ):
        cache.signal_at(1, 0, "nope")
    with pytest.raises(CacheError, match=r"has \d+ shards, not shard 99"):
        cache.signal_at(99, 0, "nope")


def test_interrupted_run_resumes_to_an_identical_cache(
    s3, prepared, tiny_teacher, monkeypatch, tmp_path
):
    full, partial = "s3://crosskd-test/cache/ref", "s3://crosskd-test/cache/resumed"
    reference = score(_score_config(prepared, tiny_teacher, full), progress=False)
    import crosskd.teacher.scoring as scoring

    real, calls = scoring._score_shard, []

    def dying(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(scoring, "_score_shard", dying)
    with pytest.raises(KeyboardInterrupt):
        score(_score_config(prepared, tiny_teacher, partial), progress=False)
    names = {p.rsplit("/", 1)[-1] for p in s3.ls("crosskd-test/cache/resumed")}
    assert "manifest.json" not in names and {"part-000000.parquet", "part-000001.parquet"} <= names
    assert not any(n.startswith(".") for n in names)  # no temporary file left
    monkeypatch.setattr(scoring, "_score_shard", real)
    calls.clear()
    resumed = score(_score_config(prepared, tiny_teacher, partial), progress=False)
    assert resumed["shards"] == reference["shards"]  # same bytes: same sha256 per shard
    assert resumed["samples"] == reference["samples"] == len(TEXTS)
    assert resumed["bits_per_byte"] == pytest.approx(reference["bits_per_byte"], rel=1e-12)
    for shard in reference["shards"]:
        assert s3.cat_file(f"crosskd-test/cache/resumed/{shard['path']}") == s3.cat_file(
            f"crosskd-test/cache/ref/{shard['path']}"
        )
    with pytest.raises(CrosskdError, match=r"holds a cache .* with another config_fingerprint"):
        score(_score_config(prepared, tiny_teacher, partial, tau=2.0), progress=False)
    other = tmp_path / "other-teacher"
    shutil.copytree(tiny_teacher, other)
    model = load_teacher(str(other)).model
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    model.save_pretrained(str(other), safe_serialization=True)
    with pytest.raises(CrosskdError, match=r"holds a cache .* with another teacher_fingerprint"):
        score(_score_config(prepared, other, partial), progress=False)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b'{"config_fingerprint": "ab', r"is damaged: not valid JSON \(Unterminated string"),
        (b"\xff\xfe\x00garbage", r"is damaged: not valid JSON"),
        (b"", r"is damaged: not valid JSON \(Expecting value\)"),
        (b'["config_fingerprint"]', r"is damaged: a JSON list, not an object"),
        (
            b'{"config_fingerprint": "ab", "dtype": "torch.float32"}',
            r"lacks data_fingerprint, teacher_fingerprint, device_type, token_budget \(damaged",
        ),
    ],
)
def test_a_damaged_run_record_is_refused_in_one_line(
    prepared, tiny_teacher, tmp_path, capsys, content, problem
):
    """A rerun reads the earlier run's run.json: a damaged one (or one missing keys) is a
    CrosskdError naming the file and what to do, and the CLI prints it as one line."""
    out = tmp_path / "cache"
    out.mkdir()
    (out / "run.json").write_bytes(content)
    advice = r"; delete that output \(or the file\) to start afresh, or choose another output\.$"
    with pytest.raises(CrosskdError, match=problem) as caught:
        score(_score_config(prepared, tiny_teacher, str(out)), progress=False)
    message = str(caught.value)
    assert message.startswith(f"{out}/run.json (the record of an earlier scoring run")
    assert re.search(advice, message) and "\n" not in message
    assert caught.value.__suppress_context__ or caught.value.__context__ is None
    assert not (out / "manifest.json").exists()
    code = main(
        [
            "score",
            "--data",
            prepared,
            "--teacher",
            str(tiny_teacher),
            "--output",
            str(out),
            "--k",
            "8",
        ]
    )
    err = capsys.readouterr().err  # after transformers' progress bars: the error line
    assert code == 2 and "Traceback" not in err
    assert err.endswith(f"crosskd: error: {message}\n") and message.count("\n") == 0


def test_a_run_record_with_extra_keys_is_refused(prepared, tiny_teacher, tmp_path, monkeypatch):
    """A complete run.json with a key this version does not write (another version's) is
    refused too, naming the key; the same record without it resumes."""
    import crosskd.teacher.scoring as scoring

    out = tmp_path / "cache"

    def dying(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(scoring, "_score_shard", dying)
    with pytest.raises(KeyboardInterrupt):
        score(_score_config(prepared, tiny_teacher, str(out)), progress=False)
    record = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps(record | {"new_key": 1}))
    with pytest.raises(CrosskdError, match=r"whose run.json also records new_key"):
        score(_score_config(prepared, tiny_teacher, str(out)), progress=False)
    (out / "run.json").write_text(json.dumps(record))
    with pytest.raises(KeyboardInterrupt):  # accepted: it gets as far as scoring again
        score(_score_config(prepared, tiny_teacher, str(out)), progress=False)


def test_a_corrupted_shard_is_detected_by_its_checksum(s3, prepared, tiny_teacher):
    uri = "s3://crosskd-test/cache/corrupt"
    manifest = score(_score_config(prepared, tiny_teacher, uri, encoding="lossy"), progress=False)
    path = f"crosskd-test/cache/corrupt/{manifest['shards'][1]['path']}"
    payload = bytearray(s3.cat_file(path))
    payload[len(payload) // 2] ^= 0xFF
    s3.pipe_file(path, bytes(payload))
    cache = open_cache(uri)
    cache.shard(0)
    with pytest.raises(CacheError, match=r"part-000001.parquet has sha256 .* the manifest says"):
        cache.shard(1)


def test_online_signal_equals_the_cached_signal(prepared, tiny_teacher, tmp_path):
    out = str(tmp_path / "cache")
    score(_score_config(prepared, tiny_teacher, out), progress=False)
    cache = open_cache(out)
    teacher = load_teacher(str(tiny_teacher))
    reader = PackedRows(load_prepared(prepared))
    order = ShardOrder(reader.shard_sizes(), seed=0, window_shards=1)
    read = [reader.row(*order.locate(r)) for r in (0, 1, order.rows - 1)]
    batch = collate([samples for samples, _ in read], n_teachers=1)
    side = batch.models["teacher0"]
    where = [
        (order.locate(r)[0], first)
        for r, (_, first) in zip((0, 1, order.rows - 1), read, strict=True)
    ]
    cached = cache.batch(where, batch.sample_ids, side.input_ids.shape[1])
    online = online_signal(
        lambda seqs: score_all(teacher, seqs, k=8, tau=1.0, token_budget=64),
        side,
        k=8,
        tau=1.0,
        vocab_size=teacher.vocab_size,
    )
    valid = side.segment_ids >= 0
    assert torch.equal(cached.ids[valid], online.ids[valid])
    torch.testing.assert_close(cached.log_probs[valid], online.log_probs[valid])
    torch.testing.assert_close(cached.realized, online.realized)
    assert cached.k == online.k == 8 and cached.vocab_size == online.vocab_size


def test_cli_score_and_bad_configs(prepared, tiny_teacher, tmp_path, capsys):
    out = str(tmp_path / "cli")
    code = main(
        [
            "score",
            "--data",
            prepared,
            "--teacher",
            str(tiny_teacher),
            "--output",
            out,
            "--k",
            "4",
            "--encoding",
            "lossy",
            "token_budget=32",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert f"scored {len(TEXTS)} samples" in printed and "top-4 at tau 1.0, lossy" in printed
    assert (
        main(
            [
                "score",
                "--data",
                prepared,
                "--teacher",
                str(tiny_teacher),
                "--output",
                str(tmp_path / "bad"),
                "--k",
                "0",
            ]
        )
        == 2
    )
    assert "k is 0; the cache stores a top K" in capsys.readouterr().err
    assert (
        main(
            [
                "score",
                "--data",
                prepared,
                "--teacher",
                "zoo:qwen3",
                "--output",
                str(tmp_path / "bad2"),
            ]
        )
        == 2
    )
    assert "unknown zoo model 'qwen3'" in capsys.readouterr().err
    with pytest.raises(CrosskdError, match="teacher_index is 3, but prepared data"):
        score(_score_config(prepared, tiny_teacher, str(tmp_path / "bad3"), teacher_index=3))
    with pytest.raises(CacheError, match=r"no manifest\.json"):
        open_cache(str(tmp_path / "bad"))


def test_teacher_references_and_refusals(tiny_teacher, tmp_path, s3):
    from crosskd.teacher.model import TeacherError

    local = load_teacher(str(tiny_teacher))
    assert local.dtype == torch.float32 and local.device.type == "cpu"
    # The same folder from S3 is copied to the cache and has the same fingerprint.
    s3.put(str(tiny_teacher) + "/", "crosskd-test/teachers/tiny/", recursive=True)
    remote = load_teacher("s3://crosskd-test/teachers/tiny/", cache_dir=tmp_path / "cache")
    assert remote.fingerprint == local.fingerprint
    assert remote.folder.parent == tmp_path / "cache" / "models"
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copyfile(tiny_teacher / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(TeacherError, match=r"no \*\.safetensors weights .* never unpickles"):
        load_teacher(str(pickled))
    with pytest.raises(TeacherError, match=r"not a folder, a zoo:NAME, an fsspec URI"):
        load_teacher("someone/not-downloaded-model")
    with pytest.raises(TeacherError, match="dtype 'float33' is not a torch dtype"):
        load_teacher(str(tiny_teacher), dtype="float33")
