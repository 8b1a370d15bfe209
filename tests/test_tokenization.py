"""Loading tokenizers, the byte view of ids, roles, fingerprints and refusals."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import fsspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from crosskd.errors import TokenizerError
from crosskd.tokenization import KIND_NONE, KIND_NORMAL, KIND_SPECIAL, load_tokenizer
from crosskd.tokenization.byte_level import byte_level_to_bytes, bytes_to_byte_level

CORPUS = ["Hello world, héllo wörld! 123 4567", "Ünïcödé text\twith\nnewlines  ", "日本語 ✓"] * 20


def _tiny(
    folder: Path,
    *,
    model="bpe",
    pre="bytelevel",
    normalizer=None,
    specials=(),
    config=None,
    bpe=None,
):
    """Train a tiny tokenizer with the given components into ``folder``; returns the folder.
    ``bpe``: options for both the BPE model and its trainer (affixes)."""
    if model == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", *specials])
    else:
        tok = Tokenizer(models.BPE(**(bpe or {})))
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=list(specials),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            **(bpe or {}),
        )
    if pre == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **(config or {})})
    )
    return folder


def test_llama3_byte_view_matches_tiktoken_for_every_id(zoo, tiktoken_encoding):
    llama, reference = zoo("llama3"), tiktoken_encoding("llama3")
    assert llama.hf("Hello world")["input_ids"] == [128000, 9906, 1917]
    assert llama.bytes.token_bytes(9906) == b"Hello"
    assert llama.bytes.token_bytes(1917) == b" world"
    normal = np.flatnonzero(llama.bytes.kind == KIND_NORMAL)
    assert len(normal) == 128000
    mismatched = [
        i
        for i in normal.tolist()
        if llama.bytes.token_bytes(i) != reference.decode_single_token_bytes(i)
    ]
    assert mismatched == []
    not_utf8 = 0
    for i in normal.tolist():
        try:
            llama.bytes.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            not_utf8 += 1
    assert not_utf8 > 500


def test_specials_have_their_content_as_bytes_and_a_kind(zoo):
    qwen = zoo("qwen3")
    im_end, think = 151645, 151667
    assert qwen.bytes.token_bytes(im_end) == b"<|im_end|>"
    assert qwen.bytes.kind[im_end] == KIND_SPECIAL
    assert qwen.is_special(think)
    assert len(qwen.special_ids) == 151669 - 151643
    assert np.all(qwen.bytes.kind[151669:] == KIND_NONE)
    assert qwen.vocab_size == 151936 and qwen.length == 151669


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "llama3",
            {
                "bos": "<|begin_of_text|>",
                "eos": "<|end_of_text|>",
                "eot": "<|eot_id|>",
                "turn_start": "<|start_header_id|>",
                "header_end": "<|end_header_id|>",
            },
        ),
        (
            "qwen3",
            {
                "eos": "<|endoftext|>",
                "eot": "<|im_end|>",
                "turn_start": "<|im_start|>",
                "think_open": "<think>",
                "think_close": "</think>",
            },
        ),
        (
            "deepseek-v3",
            {
                "bos": "<｜begin▁of▁sentence｜>",
                "eot": "<｜end▁of▁sentence｜>",
                "user": "<｜User｜>",
                "assistant": "<｜Assistant｜>",
            },
        ),
        ("smollm2", {"eos": "<|endoftext|>", "eot": "<|im_end|>", "turn_start": "<|im_start|>"}),
    ],
)
def test_roles_of_the_zoo(zoo, name, expected):
    tok = zoo(name)
    found = {role: tok.bytes.token_bytes(i).decode() for role, i in tok.role_ids.items()}
    for role, content in expected.items():
        assert found[role] == content
    assert "pad" not in found or name == "deepseek-v3"


def test_roles_from_the_special_map_and_overrides(tmp_path):
    folder = _tiny(
        tmp_path / "t",
        specials=("[EOS]", "[PAD]", "[X]"),
        config={"eos_token": "[EOS]", "pad_token": "[EOS]"},
    )
    tok = load_tokenizer(folder)
    eos = tok.hf.convert_tokens_to_ids("[EOS]")
    assert tok.roles == {eos: "eos"}
    tok = load_tokenizer(folder, role_overrides={"[PAD]": "pad", "[X]": "eot", "[EOS]": None})
    assert tok.role_ids == {
        "pad": tok.hf.convert_tokens_to_ids("[PAD]"),
        "eot": tok.hf.convert_tokens_to_ids("[X]"),
    }
    with pytest.raises(TokenizerError, match="no added token with that content"):
        load_tokenizer(folder, role_overrides={"hello": "eos"})
    with pytest.raises(TokenizerError, match="is not a role"):
        load_tokenizer(folder, role_overrides={"[X]": "boss"})


def test_fingerprint_is_stable_and_sensitive(tmp_path):
    base = _tiny(tmp_path / "base", specials=("<|im_end|>",), config={"chat_template": "A"})
    first = load_tokenizer(base).fingerprint
    assert load_tokenizer(base).fingerprint == first
    data = json.loads((base / "tokenizer.json").read_text())
    reformatted = tmp_path / "reformatted"
    reformatted.mkdir()
    (reformatted / "tokenizer.json").write_text(json.dumps(data, indent=3))
    (reformatted / "tokenizer_config.json").write_text((base / "tokenizer_config.json").read_text())
    assert load_tokenizer(reformatted).fingerprint == first

    def variant(name: str, edit) -> str:
        folder = tmp_path / name
        folder.mkdir()
        tok_json, config = json.loads(json.dumps(data)), {"chat_template": "A"}
        edit(tok_json, config)
        (folder / "tokenizer.json").write_text(json.dumps(tok_json))
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        return load_tokenizer(folder).fingerprint

    changed = {
        "split_special_tokens": variant("s", lambda t, c: c.update(split_special_tokens=True)),
        "clean_up": variant("c", lambda t, c: c.update(clean_up_tokenization_spaces=True)),
        "extra_special": variant(
            "x", lambda t, c: c.update(additional_special_tokens=["<|im_end|>"])
        ),
        "template": variant("t", lambda t, c: c.update(chat_template="B")),
        "merges": variant("m", lambda t, c: t["model"].update(merges=t["model"]["merges"][:-1])),
        "normalizer": variant("n", lambda t, c: t.update(normalizer={"type": "NFC"})),
        "eos": variant("e", lambda t, c: c.update(eos_token="<|im_end|>")),
    }
    assert len(set(changed.values()) | {first}) == len(changed) + 1


@pytest.mark.parametrize(
    ("kwargs", "found"),
    [
        ({"pre": "metaspace"}, "Metaspace pre-tokenizer"),
        ({"model": "wordpiece"}, "WordPiece model"),
        ({"normalizer": normalizers.NFKC()}, "NFKC normalizer"),
        (
            {"normalizer": normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])},
            "NFC, Lowercase normalizer",
        ),
    ],
)
def test_unsupported_tokenizers_are_refused(tmp_path, kwargs, found):
    folder = _tiny(tmp_path / "x", **kwargs)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(folder)
    message = str(info.value)
    assert str(folder) in message and found in message
    assert "supported" in message


@pytest.mark.parametrize(
    ("option", "value"),
    [("continuing_subword_prefix", "##"), ("end_of_word_suffix", "</w>"), ("byte_fallback", True)],
)
def test_bpe_options_that_change_token_bytes_are_refused(tmp_path, option, value):
    if option == "byte_fallback":
        folder = _tiny(tmp_path / "x")
        data = json.loads((folder / "tokenizer.json").read_text())
        data["model"][option] = value
        (folder / "tokenizer.json").write_text(json.dumps(data))
    else:
        folder = _tiny(tmp_path / "x", bpe={option: value})
    with pytest.raises(TokenizerError, match=f"BPE model with {option}="):
        load_tokenizer(folder)


def test_non_byte_level_decoder_and_strings_are_refused(tmp_path):
    folder = _tiny(tmp_path / "d")
    data = json.loads((folder / "tokenizer.json").read_text())
    data["decoder"] = {"type": "Fuse"}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="has a Fuse decoder, not ByteLevel"):
        load_tokenizer(folder)
    folder = _tiny(tmp_path / "s")
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"]["vocab"]["a b"] = len(data["model"]["vocab"])
    (folder / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="1 vocabulary entries are not ByteLevel strings"):
        load_tokenizer(folder)


def test_folder_without_tokenizer_json_is_refused(tmp_path):
    folder = _tiny(tmp_path / "t")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"has no tokenizer\.json; crosskd reads fast"):
        load_tokenizer(folder)


def test_guessed_output_size_is_logged(tmp_path, caplog):
    folder = _tiny(tmp_path / "t")
    with caplog.at_level("WARNING", logger="crosskd.tokenization"):
        tok = load_tokenizer(folder)
    assert tok.vocab_size == tok.length
    assert f"assuming the output layer has {tok.length} rows" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="crosskd.tokenization"):
        load_tokenizer(folder, vocab_size=tok.length + 3)
    assert caplog.text == ""


def test_nfc_and_empty_sequence_normalizers_are_accepted(tmp_path):
    load_tokenizer(_tiny(tmp_path / "a", normalizer=normalizers.NFC()))
    load_tokenizer(_tiny(tmp_path / "b", normalizer=normalizers.Sequence([])))


def test_sources_file_folder_uri_and_missing_hub_id(tmp_path):
    folder = _tiny(tmp_path / "t", specials=("<|endoftext|>",))
    from_folder = load_tokenizer(folder)
    from_file = load_tokenizer(folder / "tokenizer.json")
    assert from_file.bytes.token_bytes(300) == from_folder.bytes.token_bytes(300)
    fs = fsspec.filesystem("memory")
    for child in folder.iterdir():
        fs.pipe(f"/tok/{child.name}", child.read_bytes())
    from_uri = load_tokenizer("memory://tok", cache_dir=tmp_path / "cache")
    assert from_uri.fingerprint == from_folder.fingerprint
    one_file = load_tokenizer("memory://tok/tokenizer.json", cache_dir=tmp_path / "cache")
    assert one_file.fingerprint == from_file.fingerprint
    fs.pipe("/empty-folder/notes.txt", b"hello")
    with pytest.raises(TokenizerError, match=r"has no tokenizer\.json"):
        load_tokenizer("memory://empty-folder", cache_dir=tmp_path / "cache")
    assert load_tokenizer(f"file://{folder}").fingerprint == from_folder.fingerprint
    with pytest.raises(TokenizerError, match="local cache"):
        load_tokenizer("crosskd-no-such-org/no-such-model")
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer("memory://nothing-here", cache_dir=tmp_path / "cache")
    (tmp_path / "vocab.txt").write_text("a")
    with pytest.raises(TokenizerError, match=r"not a tokenizer\.json"):
        load_tokenizer(tmp_path / "vocab.txt")


def test_vocab_size_smaller_than_the_tokenizer_is_refused(tmp_path):
    folder = _tiny(tmp_path / "t")
    with pytest.raises(TokenizerError, match="output size was given as 10"):
        load_tokenizer(folder, vocab_size=10)
    tok = load_tokenizer(folder, vocab_size=512)
    assert tok.length < 400
    assert tok.bytes.kind[tok.length :].tolist() == [KIND_NONE] * (512 - tok.length)
    assert (tok.bytes.kind[: tok.length] != KIND_NONE).all()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_byte_level_round_trip(data):
    text = bytes_to_byte_level(data)
    assert len(text) == len(data)
    assert byte_level_to_bytes(text) == data


@pytest.mark.parametrize("text", ["a b", "\x00", "caf\u00e9\u0301", "日"])
def test_strings_outside_the_alphabet_have_no_byte_view(text):
    assert byte_level_to_bytes(text) is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=151935), max_size=40))
def test_concat_equals_joined_token_bytes(zoo, ids):
    qwen = zoo("qwen3")
    expected = b"".join(qwen.bytes.token_bytes(i) for i in ids)
    assert qwen.bytes.concat(np.asarray(ids, dtype=np.int64)).tobytes() == expected


def test_hub_id_is_read_from_the_local_hf_cache_only(tmp_path):
    """A hub id resolves from a Hugging Face cache laid out as huggingface_hub writes it."""
    snapshot = tmp_path / "hub" / "models--crosskd-test--tiny" / "snapshots" / ("0" * 40)
    _tiny(snapshot, specials=("<|endoftext|>",))
    (snapshot / "config.json").write_text(json.dumps({"vocab_size": 512}))
    refs = tmp_path / "hub" / "models--crosskd-test--tiny" / "refs"
    refs.mkdir()
    (refs / "main").write_text("0" * 40)
    script = (
        "from crosskd.tokenization import load_tokenizer\n"
        "tok = load_tokenizer('crosskd-test/tiny')\n"
        "print(tok.length, tok.vocab_size)\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(load_tokenizer(snapshot).length), "512"]


def test_what_loading_derives_is_kept_by_the_files_digest(tmp_path, caplog):
    folder = _tiny(tmp_path / "t", specials=("<|im_end|>",), config={"eos_token": "<|im_end|>"})
    cache = tmp_path / "cache"
    fresh = load_tokenizer(folder, cache_dir=cache)
    (entry,) = (cache / "tokenizers").iterdir()
    whole = entry.read_bytes()
    again = load_tokenizer(folder, cache_dir=cache)
    assert [*(cache / "tokenizers").iterdir()] == [entry]
    assert again.fingerprint == fresh.fingerprint
    for name in ("data", "offsets", "kind"):
        np.testing.assert_array_equal(getattr(again.bytes, name), getattr(fresh.bytes, name))
    assert again.roles == fresh.roles == {fresh.hf.eos_token_id: "eot"}
    assert again.length == fresh.length == len(fresh.hf)
    assert again.strips_content is fresh.strips_content is False
    assert again.backend.to_str() == fresh.hf.backend_tokenizer.to_str()
    assert again.vocab == json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    # the entry is what a load reads: an edited one comes back as it was edited
    with np.load(entry) as arrays:
        stored = dict(arrays)
    meta = json.loads(stored["meta"].tobytes())
    edited = json.dumps({**meta, "fingerprint": "edited"}).encode()
    np.savez(entry, **{**stored, "meta": np.frombuffer(edited, dtype=np.uint8)})
    assert load_tokenizer(folder, cache_dir=cache).fingerprint == "edited"
    # a changed file (a slow tokenizer's too) is another key
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "B"}))
    changed = load_tokenizer(folder, cache_dir=cache)
    assert changed.fingerprint not in (fresh.fingerprint, "edited")
    (folder / "merges.txt").write_text("#version: 0.2\n")
    load_tokenizer(folder, cache_dir=cache)
    assert len([*(cache / "tokenizers").iterdir()]) == 3
    (folder / "merges.txt").unlink()
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"})
    )
    # an entry cut short, damaged or inconsistent is derived and written again
    wrong = {**stored, "offsets": stored["offsets"][:-1]}
    no_tokenizer = {**stored, "backend": np.frombuffer(b'{"model": 1}', dtype=np.uint8)}
    damaged_files = (whole[: len(whole) // 2], b"", b"not a zip file", _npz(wrong))
    for damaged in (*damaged_files, _npz(no_tokenizer)):
        entry.write_bytes(damaged)
        assert load_tokenizer(folder, cache_dir=cache).fingerprint == fresh.fingerprint
        assert entry.read_bytes() == whole
    # a cache that cannot be written costs only the time
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with caplog.at_level("INFO", logger="crosskd.tokenization.derived"):
        assert load_tokenizer(folder, cache_dir=blocked).fingerprint == fresh.fingerprint
    assert "cannot keep what loading it derives" in caplog.text


def _npz(arrays: dict) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


_CACHED_LOAD = """
import json, sys
from crosskd.alignment import tokenize
from crosskd.tokenization import load_tokenizer

texts = json.loads(sys.argv[2])
out = {}
for name in ("llama3", "qwen3", "deepseek-v3"):
    tok = load_tokenizer(f"zoo:{name}", cache_dir=sys.argv[1])
    out[name] = {
        str(special): [
            [t.ids.tolist(), t.starts.tolist(), t.ends.tolist()]
            for t in tokenize(tok, texts, add_special_tokens=special, with_starts=True)
        ]
        for special in (False, True)
    }
out["transformers imported"] = "transformers" in sys.modules
print(json.dumps(out))
"""


def test_a_cached_tokenizer_encodes_as_transformers_does_without_importing_it(zoo_cache, zoo):
    """A load whose derived entry is in the cache builds the Rust tokenizer from the stored
    JSON: the same ids and offsets as the ``transformers`` tokenizer, specials in the text kept
    as text, and ``transformers`` never imported (a fresh process: the fixture's loads wrote
    the entries)."""
    texts = ["Hello  world<|eot_id|> 12345\n", "<|im_end|>é x\r\n\tüber", "", "  <think>"]
    loaded = {name: zoo(name) for name in ("llama3", "qwen3", "deepseek-v3")}
    result = subprocess.run(
        [sys.executable, "-c", _CACHED_LOAD, str(zoo_cache), json.dumps(texts)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got.pop("transformers imported") is False
    for name, encoded in got.items():
        hf = loaded[name].hf
        for special in (False, True):
            want = hf(
                texts,
                add_special_tokens=special,
                split_special_tokens=True,
                return_offsets_mapping=True,
            )
            expected = [
                [ids, [s for s, _ in spans], [e for _, e in spans]]
                for ids, spans in zip(want["input_ids"], want["offset_mapping"], strict=True)
            ]
            assert encoded[str(special)] == expected, (name, special)
    assert got["llama3"]["True"][0][0][0] == zoo("llama3").role_ids["bos"]
