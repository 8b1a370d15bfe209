"""Steps ``build_tables`` and ``validate_tables``: the sub-token table pair of the student and
one teacher (none for a same-tokenizer teacher), content-addressed by the two tokenizers'
fingerprints."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import fsspec

from crosskd.errors import TableError
from crosskd.steps.inputs import model_tokenizer
from crosskd.steps.locations import content_uri
from crosskd.tables import TablePair, build_table, load_table, save_table, validate_pair
from crosskd.tokenization import load_tokenizer

log = logging.getLogger(__name__)

TABLE_FORMAT = 1
"""Part of the tables' content key: bump it when a table's content rules change."""


def plan_tables(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """One self-contained item per teacher for :func:`build_tables` and
    :func:`validate_tables`: ``{"root", "student", "teacher"}``."""
    return [
        {"root": plan["root"], "student": plan["student"], "teacher": t} for t in plan["teachers"]
    ]


def build_tables(item: dict[str, Any], *, progress: bool = True) -> dict[str, Any]:
    """The tables of the item's ``student`` (model reference) and ``teacher`` (an entry of the
    plan's ``teachers``) under ``<root>/tables/<key>``: ``s2t.safetensors`` and ``t2s.safetensors``;
    returns ``{"index", "same_tokenizer", "s2t", "t2s", "sha256": {"s2t", "t2s"}, "uri"}``
    (URIs None for a same-tokenizer teacher). Existing complete tables are returned as they are."""
    student, teacher, root = item["student"], item["teacher"], item["root"]
    index = int(teacher["index"])
    if teacher["same_tokenizer"]:
        log.info("teacher %d has the student's tokenizer: no tables", index)
        return {
            "index": index,
            "same_tokenizer": True,
            "s2t": None,
            "t2s": None,
            "sha256": {},
            "uri": None,
        }
    s = load_tokenizer(model_tokenizer(student))
    t_folder = model_tokenizer(teacher["ref"])
    t = load_tokenizer(t_folder)  # vocab_size: the model's, from its config.json
    uri = content_uri(
        root, "tables", {"student": s.fingerprint, "teacher": t.fingerprint, "format": TABLE_FORMAT}
    )
    paths = {"s2t": f"{uri}/s2t.safetensors", "t2s": f"{uri}/t2s.safetensors"}
    fs, _ = fsspec.core.url_to_fs(uri)
    if all(fs.exists(fsspec.core.url_to_fs(p)[1]) for p in paths.values()):
        log.info("tables of teacher %d exist at %s", index, uri)
        for p in paths.values():
            load_table(p)  # a damaged file is refused here, not in training
    else:
        save_table(build_table(s, t, progress=progress), paths["s2t"])
        save_table(build_table(t, s, progress=progress), paths["t2s"])
        log.info("built the tables of teacher %d into %s", index, uri)
    digests = {
        k: hashlib.sha256(fs.cat_file(fsspec.core.url_to_fs(p)[1])).hexdigest()
        for k, p in paths.items()
    }
    return {"index": index, "same_tokenizer": False, **paths, "sha256": digests, "uri": uri}


def validate_tables(item: dict[str, Any], tables: dict[str, Any]) -> dict:
    """Validate the pair of :func:`build_tables` (of ``item``) against both tokenizers; raises
    :class:`crosskd.tables.TableError` naming the first violations, else returns ``{"index",
    "ok": True, "common_tokens", "violations": 0}``."""
    student, teacher = item["student"], item["teacher"]
    index = int(teacher["index"])
    if tables["same_tokenizer"]:
        return {"index": index, "ok": True, "common_tokens": None, "violations": 0}
    s = load_tokenizer(model_tokenizer(student))
    t_folder = model_tokenizer(teacher["ref"])
    t = load_tokenizer(t_folder)  # vocab_size: the model's, from its config.json
    s2t, t2s = load_table(tables["s2t"]), load_table(tables["t2s"])
    reports = validate_pair(s, t, s2t, t2s)
    bad = [r for r in reports if not r.ok]
    if bad:
        first = "; ".join(f"{r.direction}: {', '.join(map(str, r.violations[:3]))}" for r in bad)
        raise TableError(
            f"the tables of teacher {index} ({teacher['ref']}) at {tables['uri']} "
            f"do not validate: {first}; rebuild them with this crosskd (delete "
            f"the folder)."
        )
    common = len(TablePair(s2t, t2s).common)
    log.info("tables of teacher %d validate: %d common tokens", index, common)
    return {"index": index, "ok": True, "common_tokens": common, "violations": 0}
