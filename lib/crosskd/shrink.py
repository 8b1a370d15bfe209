"""A smaller student initialised from a pretrained model: the model with some of its decoder
layers removed (depth pruning), to be healed by distillation from the model it came from (the
*compressed student* of ``benchmarks/quality.py``).

Which layers stay: an explicit list of indices, or a count ``n``: the first two layers and the
last ``n - 2`` (removing a contiguous block after the second layer; for ``n`` of 3 or less, the
first ``n - 1`` and the last). On SmolLM2-135M (30 layers) kept to 10, before any training, on
10 kB of Python standard-library text and 6 kB of licence texts, that start measured 5.23 and
2.81 bits per byte; the first 8 and last 2 7.70 / 4.31, every third layer 6.07 / 3.51, the
first 9 and the last (the rule of Gromov et al., "The Unreasonable Ineffectiveness of the Deeper
Layers", measured on far larger models) 7.92 / 5.62. Either way the cut model needs healing: the
full model measured 1.35 / 1.16 on the same text.

The embeddings, the final norm and the output layer are kept whole; each kept layer is copied
unchanged (loading the folder numbers the layers anew, ``layer_idx`` included). The result is a
normal Hugging Face folder (safetensors weights, ``config.json`` with the new
``num_hidden_layers`` and the per-layer lists of :data:`PER_LAYER_KEYS` cut to the kept layers,
the tokenizer's files) that ``AutoModelForCausalLM`` loads.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from crosskd.errors import ConfigError, CrosskdError
from crosskd.teacher.model import model_folder, write_model_folder

log = logging.getLogger(__name__)

PER_LAYER_KEYS = ("layer_types", "no_rope_layers")
"""Config keys holding one entry per decoder layer (Qwen2/3's and Gemma's attention kinds,
SmolLM3's RoPE switch), cut to the kept layers."""
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class ShrinkReport:
    """What :func:`shrink` wrote."""

    output: str
    """The written model folder."""
    layers: list[int]
    """The original indices of the kept decoder layers, in order."""
    parameters: int
    """Parameters of the written model."""
    original_parameters: int
    """Parameters of the original model."""

    def line(self) -> str:
        """One line for a terminal or a log."""
        return (
            f"{self.output}: kept {len(self.layers)} decoder layers {self.layers}, "
            f"{self.parameters / 1e6:.1f}M of {self.original_parameters / 1e6:.1f}M parameters"
        )


def kept_layers(total: int, keep: int | list[int]) -> list[int]:
    """The indices of the decoder layers to keep of a model with ``total`` of them: ``keep`` as a
    list (sorted; each in ``[0, total)``, no repeats), or as a count ``n`` in ``[1, total]``:
    ``[0, 1, total - n + 2, ..., total - 1]`` (for ``n`` <= 3 the first ``n - 1`` and the
    last). A bad ``keep`` is a :class:`ConfigError` naming it."""
    if isinstance(keep, bool) or not isinstance(keep, int | list):
        raise ConfigError(f"layers is {keep!r}; give a count of layers or a list of indices.")
    if isinstance(keep, int):
        if not 1 <= keep <= total:
            raise ConfigError(f"layers is {keep}; the model has {total}: keep 1 to {total}.")
        return sorted({*range(min(2, keep - 1)), *range(total - keep + min(2, keep - 1), total)})
    bad = [i for i in keep if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < total]
    if not keep or bad or len(set(keep)) != len(keep):
        raise ConfigError(
            f"layers is {keep!r}; give distinct layer indices in [0, {total}) "
            f"(the model has {total} decoder layers)."
        )
    return sorted(keep)


def shrink(
    model: str, output: str, layers: int | list[int], *, dtype: str | None = None
) -> ShrinkReport:
    """Write ``model`` (any model reference: folder, ``zoo:NAME``, cached hub id) with only the
    decoder ``layers`` (:func:`kept_layers`) to the empty or new folder ``output``, in ``dtype``
    (None: the checkpoint's). Raises a :class:`CrosskdError` naming the input (an output folder
    that holds files, a model without a ``model.layers`` list of decoder layers, a bad
    ``layers``) before anything is written."""
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"output {out} exists and is not an empty folder; choose a new folder (shrink never "
            f"overwrites)."
        )
    # lazy: transformers costs ~1 s over torch, and only this function loads a model
    from transformers import AutoModelForCausalLM

    folder = model_folder(model, role="model")
    loaded = AutoModelForCausalLM.from_pretrained(
        str(folder),
        dtype=getattr(torch, dtype) if dtype else "auto",
        use_safetensors=True,
        local_files_only=True,
    )
    stack = getattr(getattr(loaded, "model", None), "layers", None)
    if not isinstance(stack, torch.nn.ModuleList):
        raise CrosskdError(
            f"model {model!r} ({type(loaded).__name__}) has no model.layers list of decoder "
            f"layers; shrink takes a decoder-only causal LM of the Llama family."
        )
    original = sum(p.numel() for p in loaded.parameters())
    keep = kept_layers(len(stack), layers)
    _keep(loaded, keep)
    write_model_folder(loaded, out, lambda partial: _copy_tokenizer(folder, partial))
    report = ShrinkReport(
        output=str(out),
        layers=keep,
        parameters=sum(p.numel() for p in loaded.parameters()),
        original_parameters=original,
    )
    log.info("shrink: %s", report.line())
    return report


def _keep(model: torch.nn.Module, keep: list[int]) -> None:
    """Cut ``model.model.layers`` and the config's :data:`PER_LAYER_KEYS` lists to ``keep``."""
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in keep)
    config = model.config
    for key in PER_LAYER_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, list) and len(value) == config.num_hidden_layers:
            setattr(config, key, [value[i] for i in keep])
    config.num_hidden_layers = len(keep)


def _copy_tokenizer(source: Path, folder: Path) -> None:
    """Copy the tokenizer files of ``source`` that ``folder`` lacks, unchanged (the student
    keeps its tokenizer's fingerprint)."""
    for name in _TOKENIZER_FILES:
        if (source / name).is_file() and not (folder / name).exists():
            shutil.copyfile(source / name, folder / name)
