"""Tokenizers and tables on S3, through a real S3 server (moto) on loopback."""

from __future__ import annotations

import numpy as np

from crosskd.cli import main
from crosskd.tables import load_table, save_table
from crosskd.tokenization import load_tokenizer
from crosskd.zoo import train_tiny_bpe, zoo_tokenizer_dir


def test_tokenizer_from_s3_is_copied_to_the_cache(s3, tmp_path):
    local = train_tiny_bpe(["hello world", "héllo wörld 123"] * 50, 300, tmp_path / "tiny")
    s3.put(str(local) + "/", "crosskd-test/tokenizers/tiny/", recursive=True)
    cache = tmp_path / "cache"
    remote = load_tokenizer("s3://crosskd-test/tokenizers/tiny/", cache_dir=cache)
    assert remote.fingerprint == load_tokenizer(local).fingerprint
    copies = list((cache / "uris").iterdir())
    assert len(copies) == 1 and (copies[0] / "tokenizer.json").is_file()
    again = load_tokenizer("s3://crosskd-test/tokenizers/tiny/", cache_dir=cache)
    assert again.fingerprint == remote.fingerprint
    assert list((cache / "uris").iterdir()) == copies


def test_tables_round_trip_through_s3_and_validate_from_the_cli(s3, built_table, zoo_cache):
    s2t_uri = "s3://crosskd-test/tables/s2t.safetensors"
    t2s_uri = "s3://crosskd-test/tables/t2s.safetensors"
    s2t, t2s = built_table("llama3", "qwen3"), built_table("qwen3", "llama3")
    save_table(s2t, s2t_uri)
    save_table(t2s, t2s_uri)
    assert sorted(s3.ls("crosskd-test/tables")) == [
        "crosskd-test/tables/s2t.safetensors",
        "crosskd-test/tables/t2s.safetensors",
    ]
    loaded = load_table(s2t_uri)
    assert loaded.source == s2t_uri and loaded.meta == s2t.meta
    np.testing.assert_array_equal(loaded.chains, s2t.chains)
    status = main(
        [
            "tables",
            "validate",
            "--student-tokenizer",
            str(zoo_tokenizer_dir("llama3", zoo_cache)),
            "--teacher-tokenizer",
            str(zoo_tokenizer_dir("qwen3", zoo_cache)),
            "--student-to-teacher",
            s2t_uri,
            "--teacher-to-student",
            t2s_uri,
        ]
    )
    assert status == 0


def test_changed_remote_tokenizer_is_copied_again(s3, tmp_path):
    first = train_tiny_bpe(["abc abd abe"] * 30, 270, tmp_path / "first")
    second = train_tiny_bpe(["xyz xyw xyv"] * 30, 270, tmp_path / "second")
    s3.put(str(first) + "/", "crosskd-test/tokenizers/moving/", recursive=True)
    cache = tmp_path / "cache"
    before = load_tokenizer("s3://crosskd-test/tokenizers/moving/", cache_dir=cache)
    s3.put(str(second) + "/", "crosskd-test/tokenizers/moving/", recursive=True)
    after = load_tokenizer("s3://crosskd-test/tokenizers/moving/", cache_dir=cache)
    assert before.fingerprint == load_tokenizer(first).fingerprint
    assert after.fingerprint == load_tokenizer(second).fingerprint != before.fingerprint
    assert len(list((cache / "uris").iterdir())) == 2
