"""``crosskd generate``: a conversation set made by sampling an instruct model's answers to
prompts, for chat distillation (each conversation one user turn and the model's answer).

Prompts come from a file of rows (a ``prompt`` column, or a ``text`` column; JSONL, Parquet,
a ``datasets`` folder, any fsspec URI) or, with ``prompts: machine:docstrings``, from this
machine's Python standard library: the first paragraph of a docstring inside one of a few
instructions (:func:`machine_prompts`).

The model answers with its own chat template (``add_generation_prompt``), sampled at
``temperature`` (nucleus ``top_p``) for at most ``max_new_tokens`` tokens; special tokens are
left out of the answer, which is stripped of surrounding whitespace. An answer that is empty is
dropped (counted in the log); one that reached ``max_new_tokens`` is kept, marked
``"finished": false``.

Output: one JSON object per line, ``{"id": "conv-<prompt index>", "messages": [{"role":
"user", ...}, {"role": "assistant", ...}], "generation": {...settings, "prompt_index",
"finished"}}``: rows that ``crosskd prepare`` reads as chat data. Prompts are answered in
batches of ``batch_size``; batch ``b`` is sampled from its own seed (``seed`` and ``b``). Its
rows are appended to the file together and synced, then ``<output>.progress.json`` (replaced
atomically) records the batches done and the file's length; a rerun after a kill cuts off what
follows that length (a torn batch) and goes on from there, so the file ends as an
uninterrupted run writes it. A rerun with other settings is refused with the setting named.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from crosskd.alignment.corpus import docstring_paragraphs
from crosskd.config import require_positive_ints
from crosskd.data.records import read_records
from crosskd.data.rollout import answer_text
from crosskd.errors import ConfigError, DataError

log = logging.getLogger(__name__)

MACHINE_PROMPTS = "machine:docstrings"
"""``prompts`` reference: instructions about this machine's standard-library docstrings."""
INSTRUCTIONS = (
    "Explain in simple words what the following text says:\n\n{text}",
    "Summarize the following in one or two sentences:\n\n{text}",
    "Give a short example of when the following would be useful:\n\n{text}",
    "What is one question a beginner might ask about the following? Ask it and answer it.\n\n"
    "{text}",
)
"""The instructions of the machine prompts; prompt ``i`` uses ``INSTRUCTIONS[i % 4]``."""
SETTINGS = (
    "model",
    "prompts",
    "system",
    "temperature",
    "top_p",
    "max_new_tokens",
    "seed",
    "batch_size",
)
"""What a conversation depends on: stored with every row, and checked when a run resumes."""


@dataclass
class GenerateConfig:
    """What ``crosskd generate`` does. Lengths are token counts of the model's tokenizer."""

    output: str
    """The JSONL file written (a local path: rows are appended batch by batch, so a rerun
    resumes)."""
    model: str = "zoo:smollm2"
    """The instruct model that answers (HF folder, ``zoo:NAME``, fsspec URI, cached hub id)."""
    prompts: str = MACHINE_PROMPTS
    """Rows with a ``prompt`` (or ``text``) column, in any format :mod:`crosskd.data.records`
    reads, or ``machine:docstrings`` (module docstring)."""
    conversations: int = 200
    """How many prompts to answer (the first ones; fewer when the prompts run out)."""
    system: str = ""
    """A system message before each prompt; empty: none (the template's default, if any)."""
    temperature: float = 0.7
    """Sampling temperature (> 0)."""
    top_p: float = 0.95
    """Nucleus sampling: the smallest set of tokens holding this much probability (0, 1]."""
    max_new_tokens: int = 128
    """Longest answer, in the model's tokens."""
    seed: int = 0
    """Seed of the sampling (batch ``b`` samples from a seed made of this and ``b``)."""
    batch_size: int = 8
    """Prompts answered together (left-padded)."""
    device: str | None = None
    """``cpu``, ``cuda``, ... (default: CUDA when available)."""
    dtype: str | None = None
    """The model's dtype (default: bfloat16 on CUDA, float32 on CPU)."""
    trust_remote_code: bool = False
    """Passed to transformers; off unless you trust the model's code."""

    def __post_init__(self) -> None:
        for key in ("output", "model", "prompts"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{key} is {value!r}; it must be a non-empty string.")
        if "://" in self.output and not self.output.startswith("file://"):
            raise ConfigError(
                f"output {self.output}: crosskd generate appends to a local file batch by "
                f"batch (so that a rerun resumes); write it locally and copy it afterwards."
            )
        require_positive_ints(self, ("conversations", "max_new_tokens", "batch_size"))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed is {self.seed!r}; it must be an integer >= 0.")
        for key, low, high in (("temperature", 0.0, float("inf")), ("top_p", 0.0, 1.0)):
            value = getattr(self, key)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (low < value <= high)
            ):
                raise ConfigError(f"{key} is {value!r}; it must be a number in ({low}, {high}].")
        if not isinstance(self.system, str):
            raise ConfigError(f"system is {self.system!r}; it must be a string (empty: none).")

    def settings(self) -> dict[str, Any]:
        """The :data:`SETTINGS` values of this config."""
        values = asdict(self)
        return {key: values[key] for key in SETTINGS}


def machine_prompts(limit: int) -> list[str]:
    """Up to ``limit`` prompts from this machine's standard-library docstrings: the first
    paragraph of each docstring of 60 to 400 characters (deduplicated, in the corpus's stable
    file order), prompt ``i`` inside ``INSTRUCTIONS[i % len(INSTRUCTIONS)]``."""
    prompts = []
    for text in docstring_paragraphs(60, 400):
        prompts.append(INSTRUCTIONS[len(prompts) % len(INSTRUCTIONS)].format(text=text))
        if len(prompts) == limit:
            break
    return prompts


def read_prompts(source: str, limit: int) -> list[str]:
    """The first ``limit`` prompts of ``source`` (``machine:docstrings`` or rows with a
    ``prompt`` or ``text`` column)."""
    if source == MACHINE_PROMPTS:
        return machine_prompts(limit)
    prompts = []
    for record in read_records(source, text_column=_prompt_column(source)):
        if record.text is None or not record.text.strip():
            raise DataError(
                f"prompts {source}: {record} has no prompt text; give each row a "
                f"non-empty prompt (or text) value."
            )
        prompts.append(record.text)
        if len(prompts) == limit:
            break
    return prompts


def generate(config: GenerateConfig, *, progress: bool = True) -> dict[str, Any]:
    """Answer the prompts of ``config`` into ``config.output`` (module docstring), resuming
    from the complete batches already there; returns ``{"output", "conversations" (rows in the
    file), "generated" (rows this call wrote), "dropped" (empty answers), "unfinished"}``."""
    # lazy: crosskd.teacher.model imports torch; the crosskd generate parser imports this module for
    # GenerateConfig (--help too) and needs no torch
    from crosskd.teacher.model import load_teacher

    output = Path(config.output.removeprefix("file://"))
    prompts = read_prompts(config.prompts, config.conversations)
    if not prompts:
        raise DataError(f"prompts {config.prompts}: no prompts found.")
    batches = [
        list(range(i, min(i + config.batch_size, len(prompts))))
        for i in range(0, len(prompts), config.batch_size)
    ]
    done, kept = _resume(output, config, len(batches))
    loaded = load_teacher(
        config.model,
        device=config.device,
        dtype=config.dtype,
        role="model",
        trust_remote_code=config.trust_remote_code,
    )
    tokenizer = _tokenizer(loaded.folder)
    settings = config.settings()
    written = dropped = unfinished = 0
    output.parent.mkdir(parents=True, exist_ok=True)
    with (
        output.open("ab") as handle,
        tqdm(
            total=len(batches), initial=done, desc="generate", unit="batch", disable=not progress
        ) as bar,
    ):
        for b in range(done, len(batches)):
            answers = _answer(
                loaded,
                tokenizer,
                [prompts[i] for i in batches[b]],
                config,
                seed=_batch_seed(config.seed, b),
            )
            lines = []
            for index, (answer, finished) in zip(batches[b], answers, strict=True):
                if not answer:
                    dropped += 1
                    continue
                unfinished += not finished
                lines.append(
                    json.dumps(
                        {
                            "id": f"conv-{index:06d}",
                            "messages": _messages(config.system, prompts[index], answer),
                            "generation": {
                                **settings,
                                "prompt_index": index,
                                "batch": b,
                                "finished": finished,
                            },
                        },
                        ensure_ascii=False,
                    )
                    + "\n"
                )
            handle.write("".join(lines).encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
            _write_progress(
                output,
                {
                    "batches": b + 1,
                    "bytes": handle.tell(),
                    "rows": kept + written + len(lines),
                    **settings,
                },
            )
            written += len(lines)
            bar.update(1)
    total = kept + written
    log.info(
        "generate: %d conversations in %s (%d written now, %d empty answers dropped, %d "
        "cut at max_new_tokens)",
        total,
        output,
        written,
        dropped,
        unfinished,
    )
    return {
        "output": str(output),
        "conversations": total,
        "generated": written,
        "dropped": dropped,
        "unfinished": unfinished,
    }


def _prompt_column(source: str) -> str:
    """``prompt`` when the first row of ``source`` has one, else ``text``."""
    try:
        next(iter(read_records(source, text_column="prompt")), None)
    except DataError:
        return "text"
    return "prompt"


def _messages(system: str, prompt: str, answer: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return [
        *messages,
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": answer},
    ]


def _batch_seed(seed: int, batch: int) -> int:
    """A seed for batch ``batch`` of a run seeded ``seed`` (the first 8 bytes of a sha256)."""
    digest = hashlib.sha256(f"crosskd-generate:{seed}:{batch}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _tokenizer(folder: Path):
    """The model's tokenizer, padding on the left (answers start right after the prompt)."""
    # lazy: transformers imports torch; the crosskd generate parser imports this module for
    # GenerateConfig (--help too) and needs neither
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        raise ConfigError(
            f"model {folder}: its tokenizer has no chat template; give an instruct (chat) model."
        )
    return tokenizer


def _answer(
    loaded, tokenizer, prompts: list[str], config: GenerateConfig, seed: int
) -> list[tuple[str, bool]]:
    """Each prompt's sampled answer and whether it ended before ``max_new_tokens``."""
    # lazy: torch; the crosskd generate parser imports this module for GenerateConfig (--help too)
    # and needs no torch
    import torch

    texts = [
        tokenizer.apply_chat_template(
            _messages(config.system, p, "")[:-1], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    batch = {k: v.to(loaded.device) for k, v in batch.items()}
    with torch.random.fork_rng(devices=[loaded.device] if loaded.device.type == "cuda" else []):
        torch.manual_seed(seed)
        out = loaded.model.generate(
            **batch,
            do_sample=True,
            temperature=float(config.temperature),
            top_p=float(config.top_p),
            top_k=0,
            max_new_tokens=config.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out[:, batch["input_ids"].shape[1] :]
    configured = loaded.model.generation_config.eos_token_id
    stops = {
        tokenizer.eos_token_id,
        *(configured if isinstance(configured, list) else [configured]),
    } - {None}
    return [answer_text(tokenizer, row, stops) for row in new.tolist()]


def progress_path(output: Path) -> Path:
    """The progress record of ``output``: ``<output>.progress.json``."""
    return output.with_name(output.name + ".progress.json")


def _write_progress(output: Path, record: dict[str, Any]) -> None:
    path = progress_path(output)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, path)


def _resume(output: Path, config: GenerateConfig, batches: int) -> tuple[int, int]:
    """The batches done in ``output`` and their rows, from its progress record; what the file
    holds past the recorded length (a torn batch) is cut off. A file without a record, or one
    made with other settings or for more batches, is refused."""
    progress = progress_path(output)
    if not progress.exists():
        if output.exists() and output.stat().st_size:
            raise ConfigError(
                f"output {output} exists but has no {progress.name}: it was not "
                f"written by crosskd generate; remove it or write elsewhere."
            )
        return 0, 0
    record = json.loads(progress.read_text(encoding="utf-8"))
    for key in SETTINGS:
        if record.get(key) != getattr(config, key):
            raise ConfigError(
                f"output {output} holds conversations generated with {key}="
                f"{record.get(key)!r}, not {getattr(config, key)!r}; write to another output "
                f"or remove it (and {progress.name}) to start over."
            )
    if record["batches"] > batches:
        raise ConfigError(
            f"output {output} holds {record['batches']} batches, more than the "
            f"{batches} of conversations={config.conversations}; raise "
            f"conversations or write elsewhere."
        )
    size = output.stat().st_size if output.exists() else 0
    if size < record["bytes"]:
        raise DataError(
            f"output {output} is {size} bytes, shorter than the {record['bytes']} "
            f"its {progress.name} records; remove both to start over."
        )
    if size > record["bytes"]:
        log.warning(
            "generate: %s ends in an unfinished batch (%d bytes); it is written again",
            output,
            size - record["bytes"],
        )
        with output.open("r+b") as handle:
            handle.truncate(record["bytes"])
    log.info(
        "generate: resuming %s after %d of %d batches (%d conversations)",
        output,
        record["batches"],
        batches,
        record["rows"],
    )
    return int(record["batches"]), int(record["rows"])
