"""Held-out bits per byte of causal LMs on prepared data: comparable across tokenizers.

Each sample is scored alone (right-padded batches by a token budget, attention masked); the
negative log likelihood of its target tokens, in bits (nats / ln 2), is divided by those tokens'
UTF-8 bytes. The targets (:func:`prepared_targets`) of a text sample are every token after the
first; of a chat sample, the tokens of its assistant turns (each model's own tokens of the same
characters, so the bytes agree across tokenizers) without special tokens such as the end of
turn (no bytes; templates differ): the bits per byte of the answers.
:func:`nll_bits_and_bytes` gives both sums, so shares computed by several processes add up;
:func:`bits_per_byte` is their ratio. :func:`evaluate` (``crosskd evaluate``) scores any number
of models and teachers on prepared data, each on the token ids of the prepared model whose
tokenizer it has, and writes one JSON file; ``crosskd distill`` and the trainer's held-out
evaluation report the same figure.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import fsspec
import numpy as np
import torch

from crosskd.alignment.sample import REGION_ANSWER, REGION_REASONING
from crosskd.data.collate import load_prepared
from crosskd.errors import ConfigError
from crosskd.teacher.model import load_teacher, model_folder
from crosskd.teacher.scoring import budget_batches
from crosskd.tokenization import LoadedTokenizer, load_tokenizer

if TYPE_CHECKING:
    from crosskd.parallel.parallelize import Lockstep

log = logging.getLogger(__name__)


def nll_bits_and_bytes(
    model: torch.nn.Module,
    sequences: list[np.ndarray],
    token_bytes: np.ndarray,
    *,
    device: torch.device | str = "cpu",
    token_budget: int = 4096,
    targets: list[np.ndarray] | None = None,
    lockstep: Lockstep | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[float, int]:
    """The summed negative log likelihood in bits of the target tokens of each of
    ``sequences`` (int token ids ``[L_i]``), and those tokens' UTF-8 bytes; ``token_bytes`` int
    ``[V]``: each id's UTF-8 length; ``targets``: bool ``[L_i]`` per sequence, the tokens that
    count (their first entry is ignored: the first token has no prediction); None: every token
    after the first. ``lockstep``: for a model sharded over processes, called before every
    forward pass, and its ``finish()`` at the end
    (:class:`crosskd.parallel.parallelize.Lockstep`). ``compute_dtype``: every forward pass (the
    lockstep's one-token passes included) runs under autocast to it, as the training steps do
    (None: the parameters' dtype). The per-sequence terms: :func:`sequence_bits_and_bytes`."""
    bits, n_bytes = sequence_bits_and_bytes(
        model,
        sequences,
        token_bytes,
        device=device,
        token_budget=token_budget,
        targets=targets,
        lockstep=lockstep,
        compute_dtype=compute_dtype,
    )
    return float(bits.sum()), int(n_bytes.sum())


@torch.no_grad()
def sequence_bits_and_bytes(
    model: torch.nn.Module,
    sequences: list[np.ndarray],
    token_bytes: np.ndarray,
    *,
    device: torch.device | str = "cpu",
    token_budget: int = 4096,
    targets: list[np.ndarray] | None = None,
    lockstep: Lockstep | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`nll_bits_and_bytes` of each sequence alone: float64 ``[N]`` bits and int64 ``[N]``
    UTF-8 bytes, in the order of ``sequences`` (what a paired comparison of two models over
    documents needs, :mod:`crosskd.paired`)."""
    was_training = model.training
    model.eval()
    autocast = torch.autocast(
        torch.device(device).type, dtype=compute_dtype, enabled=compute_dtype is not None
    )
    with autocast:
        result = _per_sequence(
            model, sequences, token_bytes, device, token_budget, targets, lockstep
        )
    model.train(was_training)
    return result


def _per_sequence(
    model: torch.nn.Module,
    sequences: list[np.ndarray],
    token_bytes: np.ndarray,
    device: torch.device | str,
    token_budget: int,
    targets: list[np.ndarray] | None,
    lockstep: Lockstep | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Float64 ``[N]`` bits and int64 ``[N]`` UTF-8 bytes of each sequence's target tokens."""
    bits = np.zeros(len(sequences), dtype=np.float64)
    n_bytes = np.zeros(len(sequences), dtype=np.int64)
    for group in budget_batches([len(s) for s in sequences], token_budget):
        batch = [sequences[i] for i in group]
        width = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        counted = torch.zeros(len(batch), width, dtype=torch.bool)
        for b, i in enumerate(group):
            seq = sequences[i]
            ids[b, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            mask[b, : len(seq)] = 1
            counted[b, : len(seq)] = True if targets is None else torch.as_tensor(targets[i])
        ids, mask = ids.to(device), mask.to(device)
        if lockstep is not None:
            lockstep()
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        # logit - logsumexp: float32 log_softmax can lose the small entries' mass next to a
        # dominant logit (up to ~5e-4 nats); logsumexp stays within a few ulps.
        picked = logits.gather(-1, ids[:, 1:, None])[..., 0].float()
        lp = picked - torch.logsumexp(logits.float(), dim=-1)
        keep = counted[:, 1:].to(lp.device)
        row_bits = -torch.where(keep, lp.double(), 0.0).sum(dim=1).cpu().numpy() / math.log(2)
        row_bytes = (token_bytes[ids[:, 1:].cpu().numpy()] * keep.cpu().numpy()).sum(axis=1)
        bits[group] = row_bits
        n_bytes[group] = row_bytes
    if lockstep is not None:
        lockstep.finish()
    return bits, n_bytes


def bits_per_byte(
    model: torch.nn.Module,
    sequences: list[np.ndarray],
    token_bytes: np.ndarray,
    *,
    device: torch.device | str = "cpu",
    token_budget: int = 4096,
) -> float:
    """Bits per byte of ``model`` on ``sequences`` (see :func:`nll_bits_and_bytes`); NaN when
    no token is predicted."""
    bits, n_bytes = nll_bits_and_bytes(
        model, sequences, token_bytes, device=device, token_budget=token_budget
    )
    return bits / n_bytes if n_bytes else float("nan")


def prepared_sequences(data, name: str) -> list[np.ndarray]:
    """Every sample's token ids for the prepared model ``name`` (``student``, ``teacher0``,
    ...) of :class:`crosskd.data.collate.PreparedData` ``data``, in order."""
    return [np.asarray(s[f"{name}_ids"]) for row in data.packed_rows() for s in row]


def prepared_targets(
    data, name: str, tok: LoadedTokenizer, *, digits: bool = False
) -> list[np.ndarray]:
    """Every sample's target tokens for the prepared model ``name`` (tokenizer ``tok``) of
    ``data`` (the order of :func:`prepared_sequences`), bool ``[L_i]``: a text sample's every
    token after the first; a chat sample's tokens of the content of its assistant turns: the
    tokens of its ``reasoning`` and ``answer`` chunks whose student tokens all lie in the
    student's CE loss mask (the chunks of teacher 0 for the student), special tokens left out
    (an end of turn, a ``</think>`` that one tokenizer has as a special token and another spells
    out: template text, not content). ``digits``: of those, only the tokens spelled by ASCII
    digits alone (:attr:`~crosskd.tokenization.byte_level.ByteVocab.digits`): the numbers'
    digits, the same bytes for two tokenizers that both keep digits apart from other
    characters (Llama-3 packs up to three in a token, SmolLM2 and Qwen3 one)."""
    targets = []
    for row in data.packed_rows():
        for sample in row:
            ids = np.asarray(sample[f"{name}_ids"])
            if sample.get("messages") is None:
                target = np.ones(len(ids), dtype=bool)
            else:
                target = _content_tokens(sample, name, len(ids))
                target &= ~np.isin(ids, tok.special_ids)
            if digits:
                target &= tok.bytes.digits[ids]
            target[:1] = False
            targets.append(target)
    return targets


def _content_tokens(sample: dict, name: str, length: int) -> np.ndarray:
    """A chat sample's tokens of model ``name`` in the content of its assistant turns (see
    :func:`prepared_targets`), bool ``[length]``."""
    loss_mask = np.asarray(sample["student_loss_mask"], dtype=bool)
    teacher, side = ("teacher0", "s") if name == "student" else (name, "t")
    region = np.asarray(sample[f"{teacher}_chunk_region"])
    content = np.isin(region, (REGION_REASONING, REGION_ANSWER))
    if sample[f"{teacher}_chunk_s0"] is None:  # the student's tokenizer: one entry per token
        return loss_mask & content
    target = np.zeros(length, dtype=bool)
    columns = [sample[f"{teacher}_chunk_{x}"] for x in ("s0", "s1", f"{side}0", f"{side}1")]
    for keep, s0, s1, start, stop in zip(content, *columns, strict=True):
        if keep and s1 > s0 and loss_mask[s0:s1].all():
            target[start:stop] = True
    return target


TOKENS = ("all", "digits")
"""The values of ``EvaluateConfig.tokens``."""


@dataclass
class EvaluateConfig:
    """What ``crosskd evaluate`` does."""

    data: str
    """Prepared data (``crosskd prepare`` output, e.g. a held-out split), any fsspec URI."""
    models: list[str]
    """The models to score: ``NAME=REF`` or ``REF`` (then named by REF); REF is a Hugging Face
    folder, fsspec URI, ``zoo:NAME`` or cached hub id. Each is scored on the token ids of the
    prepared model (student or a teacher) whose tokenizer fingerprint its tokenizer has."""
    output: str | None = None
    """Where the JSON result goes (local path or URI); None: only returned / printed."""
    token_budget: int = 4096
    """Padded tokens per forward batch."""
    device: str | None = None
    """``cpu``, ``cuda``, ... (default: CUDA when available)."""
    dtype: str | None = "float32"
    """The models' dtype while scoring (float32 by default, so figures compare)."""
    trust_remote_code: bool = False
    """Passed to transformers; off unless you trust the models' code."""
    tokens: str = "all"
    """Which target tokens count: ``all``, or ``digits``: only those spelled by ASCII digits
    alone (the bits per byte of the numbers in the text; :func:`prepared_targets`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.data, str) or not self.data:
            raise ConfigError(f"data is {self.data!r}; give the prepared data's URI.")
        if self.tokens not in TOKENS:
            raise ConfigError(
                f"tokens is {self.tokens!r}; write one of {', '.join(TOKENS)} (digits: only "
                f"the tokens spelled by digits alone count)."
            )
        if (
            not isinstance(self.models, list)
            or not self.models
            or not all(isinstance(m, str) and m for m in self.models)
        ):
            raise ConfigError(
                f"models is {self.models!r}; give one or more NAME=REF or REF strings."
            )
        if (
            isinstance(self.token_budget, bool)
            or not isinstance(self.token_budget, int)
            or (self.token_budget < 1)
        ):
            raise ConfigError(f"token_budget is {self.token_budget!r}; it must be an int >= 1.")
        for key in ("output", "device", "dtype"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{key} is {value!r}; it must be a non-empty string or null.")
        if self.device is not None:
            try:
                torch.device(self.device)
            except RuntimeError as exc:
                raise ConfigError(
                    f"device is {self.device!r}, not a torch device ({exc}); write cpu, cuda "
                    f"or cuda:N."
                ) from exc
        if not isinstance(self.trust_remote_code, bool):
            raise ConfigError(
                f"trust_remote_code is {self.trust_remote_code!r}; write true or false."
            )
        if len(set(self.names)) != len(self.names):
            raise ConfigError(
                f"models {self.models}: two models have the same name; name them NAME=REF."
            )

    @property
    def names(self) -> list[str]:
        """The name of each model (``NAME`` of ``NAME=REF``, else REF)."""
        return [m.partition("=")[0] if "=" in m else m for m in self.models]


def evaluate(config: EvaluateConfig) -> dict:
    """Held-out bits per byte of every model of ``config`` on its prepared data; returns (and
    writes to ``config.output``) ``{"data": URI, "data_fingerprint": ..., "tokens": ...,
    "models": {name: {"ref", "prepared_model", "bits_per_byte", "bits", "bytes", "sequences",
    "sequence_bits", "sequence_bytes"}}}`` (the last two: each sample's bits and UTF-8 bytes of
    the counted tokens, in the data's order)."""
    data = load_prepared(config.data)
    by_fingerprint = {m["fingerprint"]: m["name"] for m in data.manifest["models"]}
    results = {}
    for name, spec in zip(config.names, config.models, strict=True):
        ref = spec.partition("=")[2] if "=" in spec else spec
        tok = load_tokenizer(str(model_folder(ref, role="model")))
        prepared = by_fingerprint.get(tok.fingerprint)
        if prepared is None:
            raise ConfigError(
                f"model {name} ({ref}): its tokenizer (fingerprint {tok.fingerprint[:12]}) is "
                f"none of the tokenizers {config.data} was prepared for "
                f"({', '.join(f'{n} {f[:12]}' for f, n in by_fingerprint.items())}); prepare "
                f"the data with this tokenizer too."
            )
        loaded = load_teacher(
            ref,
            device=config.device,
            dtype=config.dtype,
            role="model",
            trust_remote_code=config.trust_remote_code,
        )
        sequences = prepared_sequences(data, prepared)
        per_bits, per_bytes = sequence_bits_and_bytes(
            loaded.model,
            sequences,
            tok.bytes.lengths,
            device=loaded.device,
            token_budget=config.token_budget,
            targets=prepared_targets(data, prepared, tok, digits=config.tokens == "digits"),
        )
        bits, n_bytes = float(per_bits.sum()), int(per_bytes.sum())
        results[name] = {
            "ref": ref,
            "prepared_model": prepared,
            "sequences": len(sequences),
            "bits": bits,
            "bytes": n_bytes,
            "bits_per_byte": bits / n_bytes if n_bytes else None,
            "sequence_bits": per_bits.tolist(),
            "sequence_bytes": per_bytes.tolist(),
        }
        log.info(
            "%s: %.4f bits per byte on %s", name, results[name]["bits_per_byte"] or 0, prepared
        )
        del loaded
    out = {
        "data": config.data,
        "data_fingerprint": data.manifest["data_fingerprint"],
        "tokens": config.tokens,
        "models": results,
    }
    if config.output is not None:
        fs, path = fsspec.core.url_to_fs(config.output)
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        if parent:
            fs.makedirs(parent, exist_ok=True)
        fs.pipe_file(path, json.dumps(out, indent=1).encode())
    return out
