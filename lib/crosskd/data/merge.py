"""Merging the shards of ``crosskd prepare`` into ``manifest.json``.

The splits of a run (:func:`crosskd.data.prepare.prepare_split`) write one shard and one shard
record per input window, and a record per split that has read the whole input. The merge checks
that every window of the input has its shard, that no sample id is used twice, and writes the
manifest (last, so a folder with a manifest is complete): the run's settings, the sums over
shards (rows, clipped rows, tokens and chunk shapes per model), packing (packed rows and
efficiency: tokens over packed-row slots), each shard's rows, packed rows ``[start, stop)`` in
the run's numbering, sha256 and footer (where it lies and its sha256, for ranged reads:
:mod:`crosskd.ranges`; absent for a shard written before), and the data fingerprint (sha256 of
the shards' content digests in order).

Memory: the shard records are read one at a time; the id check holds 12 bytes per sample (a
64-bit hash of each id and its shard), about 1.2 GB for 100 million samples.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import posixpath

import fsspec
import numpy as np
import pyarrow.parquet as pq

from crosskd.artifacts import MANIFEST
from crosskd.data.records import duplicate_id_message
from crosskd.data.run_files import RUN, SPLITS, id_hash, read_shard_record
from crosskd.errors import DataError

log = logging.getLogger(__name__)


def splits_done(output: str) -> bool:
    """Whether every split of the run at ``output`` has recorded that it is done (the splits
    of one split count, all of them)."""
    fs, root = fsspec.core.url_to_fs(output)
    markers = _markers(fs, root)
    counts = {m["split_count"] for m in markers}
    return any(
        {m["split_index"] for m in markers if m["split_count"] == n} == set(range(n))
        for n in counts
    )


def merge_prepared(output: str) -> dict:
    """Write the manifest of the prepared data at ``output`` from its shard records (see the
    module docstring); returns it (the existing one when the folder is already merged).
    Raises :class:`~crosskd.errors.DataError` naming the missing windows and the split that
    owns them, or both rows of a repeated sample id."""
    fs, root = fsspec.core.url_to_fs(output)
    if fs.exists(f"{root}/{MANIFEST}"):
        return json.loads(fs.cat_file(f"{root}/{MANIFEST}"))
    if not fs.exists(f"{root}/{RUN}"):
        raise DataError(f"output {output}: no prepare run there ({RUN}); run `crosskd prepare`.")
    run = json.loads(fs.cat_file(f"{root}/{RUN}"))
    markers = _markers(fs, root)
    if not markers:
        raise DataError(
            f"output {output}: no split has read the whole input yet ({SPLITS}/ is empty); run "
            f"`crosskd prepare` (every split) first."
        )
    windows = {m["windows"] for m in markers}
    if len(windows) != 1:
        raise DataError(
            f"output {output}: the splits saw different numbers of input windows "
            f"({sorted(windows)}): the input changed between them; prepare into a new output."
        )
    (n_windows,) = windows
    names = [m["name"] for m in run["models"]]
    shards, hashes, owners = [], [], []
    rows = clipped = bins = 0
    tokens = np.zeros(len(names), dtype=np.int64)
    shapes: dict[str, dict[str, int]] = {}
    fallback = [False] * len(names)
    content = hashlib.sha256()
    missing = []
    for w in range(n_windows):
        record = read_shard_record(fs, root, w)
        if record is None:
            missing.append(w)
            continue
        shards.append(
            {
                "path": record["path"],
                "rows": record["rows"],
                "bins": [bins, bins + record["bins"]],
                "sha256": record["sha256"],
                **({"footer": record["footer"]} if "footer" in record else {}),
            }
        )
        rows += record["rows"]
        clipped += record["clipped_rows"]
        bins += record["bins"]
        tokens += np.asarray(record["tokens"], dtype=np.int64)
        for teacher, counts in record["chunk_shapes"].items():
            total = shapes.setdefault(teacher, dict.fromkeys(counts, 0))
            for shape, n in counts.items():
                total[shape] += n
        fallback = [a or b for a, b in zip(fallback, record["chatml_fallback"], strict=True)]
        content.update(f"{record['content_sha256']}\n".encode())
        ids = np.frombuffer(base64.b64decode(record["id_hashes"]), dtype="<u8")
        hashes.append(ids)
        owners.append(np.full(len(ids), len(shards) - 1, dtype=np.int32))
    if missing:
        raise DataError(_missing_message(output, missing, markers))
    _check_unique_ids(
        output, shards, np.concatenate(hashes), np.concatenate(owners), run["config"]["id_column"]
    )
    models = [
        m | {"chatml_fallback": fallback[i], "tokens": int(tokens[i])}
        for i, m in enumerate(run["models"])
    ]
    packed = run.pop("packed")
    efficiency = {
        name: float(tokens[i]) / (bins * m["capacity"])
        for i, (name, m) in enumerate(zip(names, models, strict=True))
    }
    manifest = run | {
        "models": models,
        "rows": rows,
        "clipped_rows": clipped,
        "chunk_shapes": shapes,
        "packing": {"packed": packed, "bins": bins, "efficiency": efficiency},
        "data_fingerprint": content.hexdigest(),
        "shards": shards,
    }
    fs.pipe_file(f"{root}/{MANIFEST}", json.dumps(manifest, indent=2).encode("utf-8"))
    log.info("merged %d shards (%d rows, %d packed rows) at %s", len(shards), rows, bins, output)
    return manifest


def _markers(fs: fsspec.AbstractFileSystem, root: str) -> list[dict]:
    paths = sorted(fs.glob(f"{root}/{SPLITS}/*.json")) if fs.exists(f"{root}/{SPLITS}") else []
    return [json.loads(fs.cat_file(p)) for p in paths]


def _missing_message(output: str, missing: list[int], markers: list[dict]) -> str:
    counts = sorted({m["split_count"] for m in markers})
    owners = "; ".join(
        f"with split_count={n}: split_index "
        + ", ".join(str(i) for i in sorted({w % n for w in missing}))
        for n in counts
    )
    shown = ", ".join(str(w) for w in missing[:8]) + (", ..." if len(missing) > 8 else "")
    return (
        f"output {output}: {len(missing)} input window(s) have no shard yet ({shown}); run the "
        f"split(s) that own them ({owners}), then merge."
    )


def _check_unique_ids(
    output: str, shards: list[dict], hashes: np.ndarray, owners: np.ndarray, id_column: str | None
) -> None:
    """Refuse a sample id used twice, naming both rows (hash matches are confirmed on the ids:
    a 64-bit collision of two different ids is not an error)."""
    order = np.argsort(hashes, kind="stable")
    ordered = hashes[order]
    repeated = np.flatnonzero(ordered[1:] == ordered[:-1])
    if not repeated.size:
        return
    fs, root = fsspec.core.url_to_fs(output)
    columns: dict[int, dict] = {}
    for at in repeated.tolist():
        value = int(ordered[at])
        places = []
        for shard in sorted({int(owners[order[at]]), int(owners[order[at + 1]])}):
            if shard not in columns:
                with fs.open(f"{root}/{shards[shard]['path']}", "rb") as f:
                    columns[shard] = pq.read_table(
                        f, columns=["sample_id", "source", "row"]
                    ).to_pydict()
            table = columns[shard]
            places += [
                (sid, table["source"][i], table["row"][i])
                for i, sid in enumerate(table["sample_id"])
                if id_hash(sid) == value
            ]
        places.sort(key=lambda p: (p[1], p[2]))
        for i, (sid, source, row) in enumerate(places):
            for first in places[:i]:
                if first[0] == sid:
                    raise DataError(
                        f"output {output}: "
                        + duplicate_id_message(
                            sid, _where(first[1], first[2]), _where(source, row), id_column
                        )
                        + "; then prepare into a new output"
                    )


def _where(source: str, row: int) -> str:
    unit = "line" if posixpath.splitext(source)[1] in (".jsonl", ".json") else "row"
    return f"{source} {unit} {row}"
