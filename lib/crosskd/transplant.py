"""Tokenizer transplant: a pretrained causal LM moved onto another tokenizer
(``crosskd transplant``), the student of tokenizer transfer, which CSD then distils from the
original model.

Every row ``i`` of the new input embedding (and of an untied output layer) comes from the old
rows through the sub-token table ``new -> old`` (:func:`crosskd.tables.build.build_table`: the
chain of old pieces whose bytes are exactly the bytes of new token ``i``):

* ``mean`` (piece mean): the mean of the old rows of the chain. A token the old vocabulary
  spells identically is a chain of one, so it keeps its old row exactly; a special token takes
  the old row of the special with its role (end of turn, BOS, ...).
* A row no chain reaches (a byte the old vocabulary cannot spell, a special whose role the old
  tokenizer lacks, ids past the new tokenizer's last token) gets the mean of all old rows.
* ``tuned``: the piece mean, then ``tune_steps`` steps of training the embedding rows alone (the
  body frozen; an untied output layer too) with the next-token loss on ``tune_data`` in the new
  tokenizer: the rows learn what the body expects. (With an untied output layer, the input
  rows of tokens the text never shows keep their piece mean exactly: they get no gradient, and
  AdamW without weight decay leaves them alone; every output row learns through the softmax.)

The body is untouched. The result is a normal Hugging Face folder (safetensors weights,
``config.json`` with the new ``vocab_size`` and special ids, the new tokenizer's files) that
``AutoModelForCausalLM`` loads; tied embeddings stay tied.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from crosskd.alignment.corpus import (
    LICENCE_TEXTS,
    STDLIB_TEXTS,
    benchmark_corpus,
    licence_documents,
)
from crosskd.config import require_positive_ints
from crosskd.data.records import read_records
from crosskd.errors import ConfigError, CrosskdError, DataError
from crosskd.evaluate import bits_per_byte
from crosskd.tables.build import build_table
from crosskd.tables.format import Flag, SubTokenTable
from crosskd.teacher.model import model_folder, teacher_dtype, write_model_folder
from crosskd.tokenization import LoadedTokenizer, load_tokenizer

log = logging.getLogger(__name__)

MARKER = re.compile(r"<\|[^<>|\s]+\|>|<｜[^<>｜\s]+｜>")
"""A special-token marker as chat templates write them: ``<|im_start|>``, ``<｜User｜>``."""

METHODS = ("mean", "tuned")
"""How the new rows are made (module docstring): ``mean``, or ``tuned`` (the piece mean, then
the embedding rows trained alone)."""


@dataclass
class TransplantConfig:
    """One transplant: ``model`` moved onto ``tokenizer``, written to ``output``."""

    model: str
    """The model to move: a Hugging Face causal-LM folder (safetensors weights and its
    tokenizer), an fsspec URI of one, ``zoo:NAME`` or a hub id in the local cache."""
    tokenizer: str
    """The new tokenizer: a folder, ``tokenizer.json``, ``zoo:NAME``, an fsspec URI or a cached
    hub id; a byte-level BPE (what crosskd's tables support)."""
    output: str
    """The folder to write (local; it must not exist or be empty). Written under a temporary
    name and renamed when complete, so a failed transplant leaves nothing here."""
    method: str = "mean"
    """How new embedding rows are made from the old ones: ``mean`` (the piece mean) or
    ``tuned`` (the piece mean, then ``tune_steps`` steps of training the embeddings alone)."""
    dtype: str | None = None
    """Weights dtype of the written model (``float32``, ``bfloat16``, ``float16``); None: the
    dtype the model was saved in."""
    heldout: str | None = None
    """Text to measure held-out bits per byte on, the original model's and the moved one's
    before any training (each on its own tokens; every token after a document's first counts):
    ``machine:licences`` (``heldout_bytes`` of this machine's licence texts) or text rows
    (JSONL, Parquet, a ``datasets`` folder; their ``text`` column). None: no measurement."""
    heldout_bytes: int = 12_000
    """Size of the held-out text (UTF-8 bytes): of ``machine:licences``, or the first rows of
    a dataset until this many bytes are read."""
    tune_data: str = STDLIB_TEXTS
    """``tuned``: the text the embeddings are trained on: ``machine:stdlib`` (``tune_bytes`` of
    this machine's Python standard-library sources, docstrings and translations) or text rows
    (JSONL, Parquet, a ``datasets`` folder)."""
    tune_bytes: int = 200_000
    """Size of the tuning text (UTF-8 bytes): of ``machine:stdlib``, or the first rows of a
    dataset until this many bytes are read (the tuning draws its windows from these)."""
    tune_steps: int = 25
    """``tuned``: optimizer steps (AdamW, no weight decay, constant learning rate). 25 measured
    best on SmolLM2-135M moved onto Llama-3 (``docs/benchmarks.md``): more steps on the tuning
    text fit its domain and lose out of it."""
    tune_lr: float = 1e-3
    """``tuned``: learning rate."""
    tune_rows: int = 4
    """``tuned``: windows of ``tune_length`` tokens per step, drawn at random from the text."""
    tune_length: int = 128
    """``tuned``: tokens per window."""
    seed: int = 0
    """``tuned``: seed of the windows drawn."""

    def __post_init__(self) -> None:
        for key in ("model", "tokenizer", "output"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{key} is {value!r}; give a model, tokenizer or folder path.")
        if self.method not in METHODS:
            raise ConfigError(f"method is {self.method!r}; choose one of {', '.join(METHODS)}.")
        if self.dtype is not None:
            teacher_dtype(self.dtype, torch.device("cpu"))
        require_positive_ints(
            self, ("heldout_bytes", "tune_bytes", "tune_steps", "tune_rows", "tune_length")
        )
        lr = self.tune_lr
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
            raise ConfigError(f"tune_lr is {lr!r}; it must be a number > 0.")


@dataclass(frozen=True)
class TransplantReport:
    """What a transplant did, counted over the new vocabulary's ``[0, V_new)`` rows."""

    output: str
    """The written model folder."""
    vocab_size: int
    """Rows of the new embedding (``V_new``)."""
    kept: int
    """Rows copied from one old row: tokens spelled identically, specials mapped by role."""
    averaged: int
    """Rows made from a chain of two or more old pieces."""
    fallback: int
    """Rows no chain reaches, set to the mean of all old rows."""
    tied: bool
    """Whether the output layer shares the input embedding."""
    bits_per_byte: dict[str, float] = field(default_factory=dict)
    """Held-out bits per byte before training (``heldout``): ``original`` (the model on its own
    tokenizer) and one entry per method (the moved model); empty without ``heldout``."""

    def line(self) -> str:
        """One line for a terminal or a log."""
        measured = ", ".join(f"{name} {value:.4f}" for name, value in self.bits_per_byte.items())
        return (
            f"{self.output}: {self.vocab_size} rows, {self.kept} kept from one old row, "
            f"{self.averaged} piece means, {self.fallback} set to the mean row "
            f"({'tied' if self.tied else 'untied'} output layer)"
            + (f"; held-out bits/byte: {measured}" if measured else "")
        )


def piece_mean(old: torch.Tensor, table: SubTokenTable) -> torch.Tensor:
    """New rows ``[V_new, H]`` from the old rows ``old`` ``[V_old, H]``: the mean of the old rows
    of each new id's chain in ``table`` (``new -> old``), the mean of all old rows where the chain
    is empty. Sums run in float32 and the result has ``old``'s dtype."""
    lengths = torch.from_numpy(table.lengths)
    owners = torch.from_numpy(np.repeat(np.arange(len(table.lengths)), table.lengths))
    source = old.detach().float()
    rows = source.mean(dim=0).expand(len(lengths), -1).clone()
    sums = torch.zeros_like(rows).index_add_(
        0, owners, source[torch.from_numpy(table.chains.astype(np.int64))]
    )
    mapped = lengths > 0
    rows[mapped] = sums[mapped] / lengths[mapped, None].float()
    return rows.to(old.dtype)


def transplant(config: TransplantConfig) -> TransplantReport:
    """Move ``config.model`` onto ``config.tokenizer`` (module docstring) and write it to
    ``config.output``. Raises a :class:`CrosskdError` naming the input (a tokenizer crosskd does
    not support or whose chat template writes markers it lacks, a model without input
    embeddings, an output folder that holds files) before anything is written."""
    output = Path(config.output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ConfigError(
            f"output {output} exists and is not an empty folder; choose a new folder (a "
            f"transplant never overwrites)."
        )
    # lazy: transformers costs ~1 s over torch; crosskd.steps.config imports TransplantConfig
    # (every pipeline step imports it), and only the transplant itself loads a model
    from transformers import AutoModelForCausalLM

    new_tok = load_tokenizer(config.tokenizer)
    check_template_specials(new_tok, config.tokenizer)
    folder = model_folder(config.model, role="model")
    old_tok = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(
        str(folder),
        dtype=teacher_dtype(config.dtype, torch.device("cpu")) if config.dtype else "auto",
        use_safetensors=True,
        local_files_only=True,
    )
    texts = corpus_texts(config.heldout, config.heldout_bytes, "heldout") if config.heldout else []
    measured = {"original": text_bits_per_byte(model, old_tok, texts)} if texts else {}
    old_in = _input_embeddings(model, config.model)
    old_out = model.get_output_embeddings()
    tied = old_out is None or old_out.weight is old_in.weight
    table = build_table(new_tok, old_tok, progress=False)
    new_in = piece_mean(old_in.weight, table)
    new_out = None if tied else piece_mean(old_out.weight, table)
    model.resize_token_embeddings(new_tok.vocab_size, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(new_in)
        if new_out is not None:
            model.get_output_embeddings().weight.copy_(new_out)
    _set_special_ids(model, new_tok)
    if texts:
        measured["mean"] = text_bits_per_byte(model, new_tok, texts)
    if config.method == "tuned":
        tune_texts = corpus_texts(config.tune_data, config.tune_bytes, "tune_data")
        losses = tune_embeddings(model, new_tok, tune_texts, config)
        log.info("tuned: loss %.4f at the first step, %.4f at the last", losses[0], losses[-1])
        if texts:
            measured["tuned"] = text_bits_per_byte(model, new_tok, texts)
    write_model_folder(model, output, new_tok.hf.save_pretrained)
    lengths = table.lengths
    report = TransplantReport(
        output=str(output),
        vocab_size=new_tok.vocab_size,
        kept=int((lengths == 1).sum()),
        averaged=int((lengths > 1).sum()),
        fallback=int((lengths == 0).sum()),
        tied=tied,
        bits_per_byte=measured,
    )
    unreached = {
        flag.name.lower(): int((table.flags == flag).sum())
        for flag in (Flag.UNREPRESENTABLE, Flag.SPECIAL_UNMAPPED)
    }
    log.info("transplant: %s; rows no chain reaches: %s", report.line(), unreached)
    return report


def check_template_specials(tokenizer: LoadedTokenizer, ref: str) -> None:
    """Refuse (one line naming ``ref``) a tokenizer whose chat template writes a marker such as
    ``<|im_start|>`` that is not one of its special tokens: a model moved onto it would read
    its own conversations as pieces of text. A tokenizer without a template passes."""
    template = getattr(tokenizer.hf, "chat_template", None)
    if not template:
        return
    conversation = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    rendered = tokenizer.hf.apply_chat_template(conversation, tokenize=False)
    missing = []
    for marker in sorted(set(MARKER.findall(rendered))):
        ids = tokenizer.hf.encode(marker, add_special_tokens=False)
        if len(ids) != 1 or not tokenizer.is_special(ids[0]):
            missing.append(marker)
    if missing:
        raise ConfigError(
            f"tokenizer {ref}: its chat template writes {', '.join(missing)}, which is not one "
            f"of its special tokens; give a tokenizer whose tokenizer.json has the template's "
            f"specials as added tokens."
        )


def corpus_texts(reference: str, target_bytes: int, key: str) -> list[str]:
    """The documents of ``reference`` (the value of config key ``key``): ``machine:licences``
    or ``machine:stdlib`` (about ``target_bytes`` of this machine's licence texts or Python
    standard-library text), or the ``text`` of a dataset's first rows until ``target_bytes``
    are read (a large dataset is never read whole); a row without text (a conversation) is a
    :class:`DataError` naming it."""
    if reference == LICENCE_TEXTS:
        return licence_documents(target_bytes)
    if reference == STDLIB_TEXTS:
        return benchmark_corpus(target_bytes)
    texts, read = [], 0
    for record in read_records(reference):
        if record.text is None:
            raise DataError(
                f"{key} {reference}: row {record.row} of {record.source} is a conversation; "
                f"give text rows (a text column)."
            )
        texts.append(record.text)
        read += len(record.text.encode("utf-8"))
        if read >= target_bytes:
            break
    return texts


def tune_embeddings(
    model: torch.nn.Module,
    tokenizer: LoadedTokenizer,
    texts: list[str],
    config: TransplantConfig,
) -> list[float]:
    """Train ``model``'s input embedding (and an untied output layer) alone, the rest frozen,
    with the next-token loss on ``texts`` in ``tokenizer`` (documents joined by its EOS):
    ``config.tune_steps`` AdamW steps (no weight decay) at ``config.tune_lr``, each on
    ``config.tune_rows`` windows of ``config.tune_length`` tokens drawn with ``config.seed``.
    Returns the loss of every step (nats per token)."""
    eos = tokenizer.hf.eos_token_id
    stream = []
    for text in texts:
        stream += tokenizer.hf(text, add_special_tokens=False)["input_ids"]
        stream += [] if eos is None else [eos]
    tokens = torch.tensor(stream, dtype=torch.long)
    width = config.tune_length
    if len(tokens) < width:
        raise DataError(
            f"tune_data {config.tune_data}: {len(tokens)} tokens, fewer than one window of "
            f"tune_length {width}; give more text or a shorter tune_length."
        )
    trained = [model.get_input_embeddings().weight]
    head = model.get_output_embeddings()
    if head is not None and head.weight is not trained[0]:
        trained.append(head.weight)
    was_training = model.training
    wanted = {parameter: parameter.requires_grad for parameter in model.parameters()}
    model.train()
    for parameter in wanted:
        parameter.requires_grad_(any(parameter is t for t in trained))
    optimizer = torch.optim.AdamW(trained, lr=config.tune_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(config.seed)
    losses = []
    for _ in tqdm(range(config.tune_steps), desc="tuning embeddings", leave=False):
        starts = torch.randint(0, len(tokens) - width + 1, (config.tune_rows,), generator=generator)
        batch = torch.stack([tokens[start : start + width] for start in starts.tolist()])
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss  # shifted inside
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    for parameter, flag in wanted.items():
        parameter.requires_grad_(flag)
    model.train(was_training)
    return losses


def text_bits_per_byte(
    model: torch.nn.Module, tokenizer: LoadedTokenizer, texts: list[str]
) -> float:
    """Bits per byte of ``model`` on ``texts``, each tokenized alone by ``tokenizer`` without
    special tokens; every token after a text's first is predicted
    (:func:`crosskd.evaluate.bits_per_byte`)."""
    sequences = [
        np.asarray(tokenizer.hf(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        for text in texts
    ]
    return bits_per_byte(model, sequences, tokenizer.bytes.lengths)


def _input_embeddings(model: torch.nn.Module, ref: str) -> torch.nn.Embedding:
    """The model's input embedding, or a one-line error naming ``ref``."""
    try:
        embedding = model.get_input_embeddings()
    except NotImplementedError:
        embedding = None
    if not isinstance(embedding, torch.nn.Embedding):
        raise CrosskdError(
            f"model {ref!r} ({type(model).__name__}) has no input embedding table "
            f"(nn.Embedding) to move; transplant takes a causal LM with token embeddings."
        )
    return embedding


def _set_special_ids(model: torch.nn.Module, tokenizer: LoadedTokenizer) -> None:
    """The new tokenizer's BOS, EOS and pad ids in the model's config and generation config."""
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer.hf, key, None)
        setattr(model.config, key, value)
        if model.generation_config is not None:
            setattr(model.generation_config, key, value)
