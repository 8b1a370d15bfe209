"""Step ``prepare``: the run's training, held-out and out-of-domain rows clipped, aligned and
lockstep-packed for the student and every teacher (:func:`crosskd.data.prepare.prepare`), under a
prefix keyed by the data's content, the tokenizers' fingerprints and the options."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from typing import Any

import fsspec

from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.data.records import read_records
from crosskd.errors import DataError
from crosskd.metrics.steps import PrepareMetrics, served
from crosskd.steps.inputs import model_tokenizer
from crosskd.steps.locations import content_uri, data_fingerprint
from crosskd.tokenization import load_tokenizer

log = logging.getLogger(__name__)

SPLITS = ("train", "heldout")
OOD = "ood"
"""The split of the out-of-domain held-out rows (``plan["ood_data"]``), when a run has them."""


def prepare_data(
    plan: dict[str, Any],
    *,
    max_length: int,
    shard_rows: int = 4096,
    pack: bool = True,
    workers: int = 1,
    progress: bool = True,
    metrics_port: int | None = None,
    final_scrape_s: float = 30.0,
) -> dict[str, Any]:
    """Prepare ``plan["train_data"]`` and the held-out rows (``plan["heldout_data"]``, else the
    ``plan["heldout_fraction"]`` of the training rows whose id hashes below it) and the
    out-of-domain rows ``plan["ood_data"]`` when given, for the plan's student and teachers
    (teachers get ``2 * max_length``) under ``<root>/prepared/<key>/{train,heldout}`` and
    ``<root>/prepared/<ood key>/ood`` (a key of its own: adding out-of-domain rows to a run
    prepares nothing else again); returns ``{"uri", "train", "heldout", "ood" (with
    out-of-domain rows), "train_shards", "train_rows", "rows": {split: n}, "data_fingerprint":
    {split: sha256}}`` (``train_rows``: the raw training rows after the held-out split, the
    source of on-policy prompts that are not held out). ``pack`` false: one sample per row
    (part of the key only then, so packed data keeps the key it always had). ``workers``:
    processes preparing at once (``PrepareConfig.workers``; not part of the key). A split whose
    manifest exists is not prepared again. ``metrics_port``: serve the rows prepared and clipped
    (:class:`crosskd.metrics.steps.PrepareMetrics`) there while it runs (0: a free port; None:
    not served), ``final_scrape_s`` seconds at most for a last scrape."""
    student = model_tokenizer(plan["student"])
    teachers = [model_tokenizer(t["ref"]) for t in plan["teachers"]]
    sources = {"train": plan["train_data"], "heldout": plan["heldout_data"] or None}
    options = {
        "tokenizers": [load_tokenizer(t).fingerprint for t in [student, *teachers]],
        "max_length": max_length,
        "shard_rows": shard_rows,
        **({} if pack else {"pack": False}),
    }
    key = {
        "data": {k: data_fingerprint(v) for k, v in sources.items() if v},
        "heldout_fraction": plan.get("heldout_fraction"),
        **options,
    }
    uri = content_uri(plan["root"], "prepared", key)
    targets = {split: f"{uri}/{split}" for split in SPLITS}
    if sources["heldout"] is None:
        sources |= _split(sources["train"], float(plan.get("heldout_fraction", 0.1)), f"{uri}/rows")
    if plan.get("ood_data"):
        sources[OOD] = plan["ood_data"]
        ood_key = {"data": {OOD: data_fingerprint(plan["ood_data"])}, **options}
        targets[OOD] = f"{content_uri(plan['root'], 'prepared', ood_key)}/{OOD}"
    result: dict[str, Any] = {
        "uri": uri,
        "train_rows": sources["train"],
        "rows": {},
        "data_fingerprint": {},
    }
    with served(PrepareMetrics(), metrics_port, "prepare", final_scrape_s) as metrics:
        for split, target in targets.items():
            fs, path = fsspec.core.url_to_fs(target)
            if fs.exists(f"{path}/manifest.json"):
                log.info("prepared %s data exist at %s", split, target)
                manifest = json.loads(fs.cat_file(f"{path}/manifest.json"))
            else:
                manifest = prepare(
                    PrepareConfig(
                        data=sources[split],
                        student_tokenizer=student,
                        teacher_tokenizers=teachers,
                        output=target,
                        max_length=max_length,
                        teacher_max_length=2 * max_length,
                        shard_rows=shard_rows,
                        pack=pack,
                        workers=workers,
                    ),
                    progress=progress,
                    on_row=functools.partial(metrics.row, split),
                )
            result[split] = target
            result["rows"][split] = manifest["rows"]
            result["data_fingerprint"][split] = manifest["data_fingerprint"]
            if split == "train":
                result["train_shards"] = len(manifest["shards"])
    return result


def held_out(sample_id: str, fraction: float) -> bool:
    """Whether the row ``sample_id`` is held out: the first 8 bytes of its sha256 as a number in
    [0, 1) fall below ``fraction`` (the same rows on every machine, whatever the order)."""
    value = int.from_bytes(hashlib.sha256(sample_id.encode("utf-8")).digest()[:8], "big")
    return value / 2**64 < fraction


def _split(data: str, fraction: float, folder: str) -> dict[str, str]:
    """Write the training rows of ``data`` as ``train.jsonl`` and ``heldout.jsonl`` under
    ``folder`` (ids kept) by :func:`held_out`; returns their URIs."""
    lines: dict[str, list[str]] = {split: [] for split in SPLITS}
    for record in read_records(data):
        row = {"id": record.sample_id}
        row |= {"text": record.text} if record.text is not None else {"messages": record.messages}
        lines["heldout" if held_out(record.sample_id, fraction) else "train"].append(
            json.dumps(row, ensure_ascii=False) + "\n"
        )
    for split, rows in lines.items():
        if not rows:
            raise DataError(
                f"data {data}: heldout_fraction {fraction} leaves no {split} rows "
                f"of {sum(map(len, lines.values()))}; give heldout_data or another "
                f"fraction."
            )
    fs, path = fsspec.core.url_to_fs(folder)
    fs.makedirs(path, exist_ok=True)
    for split, rows in lines.items():
        fs.pipe_file(f"{path}/{split}.jsonl", "".join(rows).encode("utf-8"))
    return {split: f"{folder}/{split}.jsonl" for split in SPLITS}
