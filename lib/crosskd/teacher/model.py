"""Loading a teacher model for scoring (offline, to the cache) or for the online signal.

A teacher reference is a Hugging Face folder, ``zoo:NAME`` (:mod:`crosskd.zoo.models`), an
fsspec URI of a folder (its config, safetensors weights and tokenizer files are copied into
the cache, keyed by the files' version stamps), or a Hugging Face id already in the local cache
(nothing is downloaded). Weights are read from safetensors only (never unpickled);
``trust_remote_code`` stays off unless asked. Device: CUDA when available, else CPU; dtype:
bfloat16 on a GPU that supports it (float16 otherwise), float32 on CPU (CPU half-precision
matmuls are slow and inexact). The teacher's fingerprint is the sha256 of its ``config.json``
and of every weight file, so a cache records exactly which weights scored it.

A teacher whose forward pass returns its linear output head's logits unchanged gets an
:class:`~crosskd.output_layer.OutputHead` in place of that head (same parameters, same logits
outside :meth:`~crosskd.output_layer.OutputHead.capture`), recorded as
:attr:`LoadedTeacher.head`: scoring then takes the head's input and computes the signal fused
with it, never making the ``tokens x V`` logits
(:func:`~crosskd.teacher.signal.signal_from_output_layer`). One that changes them (Gemma 2's
logit soft-cap) or whose head is not a plain ``nn.Linear`` keeps its head and is scored from
its logits; an INFO log line says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
import torch
from huggingface_hub import try_to_load_from_cache

from crosskd.config import default_cache_dir
from crosskd.errors import CrosskdError
from crosskd.output_layer import OutputHead, head_output_unchanged, use_output_head
from crosskd.tokenization.sources import TOKENIZER_FILES, copy_to_cache
from crosskd.zoo.models import zoo_model_dir

log = logging.getLogger(__name__)


class TeacherError(CrosskdError):
    """A teacher model cannot be found or loaded as asked."""


@dataclass(frozen=True, eq=False)
class LoadedTeacher:
    """A teacher ready to score: ``model`` (eval mode, on ``device`` in ``dtype``), ``name``
    (the reference), ``folder`` (local), ``fingerprint`` and ``vocab_size`` (output rows);
    ``lockstep``: for a teacher sharded over processes, called before every forward pass
    (:class:`crosskd.parallel.parallelize.Lockstep`); ``head``: the model's output head when
    scoring may take its input instead of the logits (:func:`fused_head`), else None;
    ``lock``: held for each forward pass and its signal, so that threads sharing the teacher
    (a trainer's input thread and its on-policy rollouts) take turns."""

    name: str
    folder: Path
    model: torch.nn.Module
    fingerprint: str
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    lockstep: Callable[[], None] | None = None
    head: OutputHead | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def default_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 (or float16) on a GPU, float32 on CPU."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def teacher_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype a teacher is loaded in on ``device``: ``dtype`` (a name such as ``bfloat16``,
    or a torch dtype), or :func:`default_dtype`."""
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise TeacherError(f"dtype {dtype!r} is not a torch dtype (float32, bfloat16, ...).")
        dtype = getattr(torch, dtype)
    return dtype or default_dtype(device)


def load_teacher(
    ref: str,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    cache_dir: str | os.PathLike | None = None,
    role: str = "teacher",
) -> LoadedTeacher:
    """Load and fingerprint a teacher (see the module docstring); ``role`` names the model in
    errors (``crosskd evaluate`` loads students the same way)."""
    # lazy: transformers costs ~1 s over torch; every pipeline step imports crosskd.steps, which
    # imports this module (through the trainer and crosskd.teacher.scoring), and most steps load no
    # teacher
    from transformers import AutoModelForCausalLM

    folder = model_folder(ref, cache_dir=cache_dir, role=role)
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        found = sorted(p.name for p in folder.iterdir())
        raise TeacherError(
            f"{role} {ref!r}: no *.safetensors weights in {folder} (found {found}); crosskd "
            f"never unpickles weights. Save the model with save_pretrained(safe_serialization="
            f"True)."
        )
    device = torch.device(device) if device is not None else default_device()
    dtype = teacher_dtype(dtype, device)
    model = AutoModelForCausalLM.from_pretrained(
        str(folder),
        dtype=dtype,
        use_safetensors=True,
        local_files_only=True,
        trust_remote_code=trust_remote_code,
    )
    model.to(device).eval()
    head = fused_head(model, f"{role} {ref}")
    vocab = int(model.get_output_embeddings().weight.shape[0])
    return LoadedTeacher(ref, folder, model, fingerprint(folder), vocab, device, dtype, head=head)


def fused_head(model: torch.nn.Module, name: str) -> OutputHead | None:
    """``model``'s output head as an :class:`~crosskd.output_layer.OutputHead` (put in place
    of its ``nn.Linear`` head, same parameters) when the model returns that head's logits
    unchanged, so its signal can be computed fused with the head; else None, with an INFO log
    line naming the model (``name``) and why. Runs one two-token forward pass."""
    why = head_output_unchanged(model)
    if why is not None:
        log.info("%s is scored from its logits, not fused with its output head: %s", name, why)
        return None
    return use_output_head(model)


def fingerprint(folder: Path) -> str:
    """sha256 over ``config.json`` and the sha256 of every ``*.safetensors`` file (reads every
    byte of the weights: a teacher sharded over processes is hashed once, by their parent)."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        file_hash = hashlib.sha256()
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                file_hash.update(block)
        digest.update(path.name.encode() + b"\0" + file_hash.digest())
    return digest.hexdigest()


def model_folder(
    ref: str, *, cache_dir: str | os.PathLike | None = None, role: str = "teacher"
) -> Path:
    """The local folder of a model reference (a teacher's, or a student's: ``role`` names it
    in errors); remote folders are copied into the cache."""
    if ref.startswith("zoo:"):
        return zoo_model_dir(ref[len("zoo:") :], cache_dir=cache_dir)
    if ref.startswith("file://"):
        ref = ref[len("file://") :]
    elif "://" in ref:
        return _fetch(ref, Path(cache_dir) if cache_dir else default_cache_dir(), role)
    path = Path(ref)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TeacherError(f"{role} folder {ref!r} has no config.json.")
        return path
    try:
        found = try_to_load_from_cache(ref, "config.json")
    except ValueError:
        found = None
    if not isinstance(found, str):
        raise TeacherError(
            f"{role} {ref!r} is not a folder, a zoo:NAME, an fsspec URI, or a Hugging Face id "
            f"in the local cache; crosskd never downloads at run time. Download it first "
            f"(`huggingface-cli download {ref}`) or pass its folder."
        )
    return Path(found).parent


def write_model_folder(
    model: torch.nn.Module, output: Path, write_tokenizer: Callable[[Path], None]
) -> None:
    """Save ``model`` (safetensors) and, by ``write_tokenizer(folder)``, its tokenizer files
    into a folder beside ``output`` under a temporary name, then rename it to ``output`` (an
    empty folder there is replaced): nothing is left at ``output`` if saving fails."""
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        model.save_pretrained(str(partial), safe_serialization=True)
        write_tokenizer(partial)
        if output.exists():
            output.rmdir()
        partial.rename(output)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _fetch(uri: str, cache_dir: Path, role: str) -> Path:
    """Copy a remote model folder (config, safetensors weights and their index, tokenizer
    files) into the cache."""
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.isdir(path):
        raise TeacherError(f"{role} {uri!r} is not a folder; check the URI and credentials.")
    wanted = TOKENIZER_FILES | {"generation_config.json"}
    entries = [
        e
        for e in fs.ls(path, detail=True)
        if e.get("type") == "file"
        and (
            Path(e["name"]).name in wanted
            or e["name"].endswith((".safetensors", ".safetensors.index.json"))
        )
    ]
    if "config.json" not in {Path(e["name"]).name for e in entries}:
        raise TeacherError(f"{role} folder {uri!r} has no config.json.")
    names = [Path(e["name"]).name for e in entries]
    return copy_to_cache(fs, uri, entries, names, cache_dir / "models")
