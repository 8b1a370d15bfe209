"""Step ``build_projection``: X-Token's projection ``W`` of the student and one teacher, built
from the teacher's validated table pair (:func:`crosskd.projection.build_projection`) and
validated against both tokenizers, content-addressed by the two fingerprints and the build's
settings. A teacher whose algorithm is ``xtoken`` is compared through it; for the others it
is a small file (about 1.5 MB for Llama-3 and SmolLM2) that costs a second."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import fsspec

from crosskd import projection as xtoken
from crosskd.errors import TableError
from crosskd.projection.format import FORMAT_VERSION
from crosskd.steps.inputs import model_tokenizer
from crosskd.steps.locations import content_uri
from crosskd.steps.tables import TABLE_FORMAT
from crosskd.tables import load_table_pair
from crosskd.tokenization import load_tokenizer

log = logging.getLogger(__name__)

FILE = "projection.safetensors"


def build_projection(item: dict[str, Any], tables: dict[str, Any]) -> dict[str, Any]:
    """``W`` of the item's ``student`` and ``teacher`` (an item of :func:`plan_tables`) from
    their ``tables`` (the output of :func:`build_tables` or :func:`validate_tables`), under
    ``<root>/projections/<key>/projection.safetensors``; returns ``tables`` with
    ``projection`` (its URI; None for a same-tokenizer teacher) and ``projection_sha256``. An
    existing projection is loaded and validated, not rebuilt; one that fails validation is
    refused with the first violations (delete it to rebuild)."""
    if tables["same_tokenizer"]:
        return {**tables, "projection": None, "projection_sha256": None}
    student, teacher, root = item["student"], item["teacher"], item["root"]
    index = int(teacher["index"])
    s = load_tokenizer(model_tokenizer(student))
    t = load_tokenizer(model_tokenizer(teacher["ref"]))
    key = {
        "student": s.fingerprint,
        "teacher": t.fingerprint,
        "tables": TABLE_FORMAT,
        "format": FORMAT_VERSION,
        "top_k": xtoken.TOP_K,
        "chain_cut": xtoken.CHAIN_CUT,
    }
    uri = f"{content_uri(root, 'projections', key)}/{FILE}"
    fs, path = fsspec.core.url_to_fs(uri)
    if fs.exists(path):
        projection = xtoken.load_projection(uri)
        log.info("the projection of teacher %d exists at %s", index, uri)
    else:
        pair = load_table_pair(tables["s2t"], tables["t2s"])
        projection = xtoken.save_projection(xtoken.build_projection(pair), uri)
        log.info("built the projection of teacher %d into %s", index, uri)
    report = xtoken.validate_projection(projection, s, t)
    if not report.ok:
        raise TableError(
            f"the projection of teacher {index} ({teacher['ref']}) at {uri} does not validate: "
            f"{'; '.join(report.violations[:3])}; delete it to rebuild it with this crosskd."
        )
    digest = hashlib.sha256(fs.cat_file(path)).hexdigest()
    return {**tables, "projection": uri, "projection_sha256": digest}
