"""Prepared-data and teacher-cache shards on S3 (moto's server on loopback) read by checked byte
ranges (:mod:`crosskd.ranges`): a packed row or a sample costs its row groups and the footer,
not the shard; the values equal a whole-shard read; a damaged row group that is read is refused
in one line naming the shard; artifacts without footers are read whole and checked as before;
and two processes of one node sharing the node cache fetch each range from S3 once."""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing

import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest
from ranged_worker import read_rows

import crosskd.data.shards
import crosskd.teacher.storage
from crosskd.data.collate import PreparedData, load_prepared
from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.data.rows import PackedRows
from crosskd.errors import DataError
from crosskd.ranges import footer_record, group_bounds
from crosskd.teacher.cache import CacheError, TeacherCache
from crosskd.teacher.storage import SampleSignal, decode, encode

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
TEXTS = [{"id": f"r{i}", "text": " ".join(WORDS[: 2 + (7 * i) % 9]) + f" {i}."} for i in range(40)]
BUCKET = "crosskd-test/ranged"


class Counting:
    """Counts the bytes the real S3 filesystem's ``cat_file`` returns (the library's reads)."""

    def __init__(self, fs) -> None:
        self.fetch, self.fetched = fs.cat_file, 0

    def __call__(self, *args, **kwargs) -> bytes:
        data = self.fetch(*args, **kwargs)
        self.fetched += len(data)
        return data


@pytest.fixture
def counting(s3, monkeypatch) -> Counting:
    assert fsspec.core.url_to_fs(f"s3://{BUCKET}")[0] is s3  # the instance the library uses
    counter = Counting(s3)
    monkeypatch.setattr(s3, "cat_file", counter)
    return counter


@pytest.fixture(scope="module")
def data_uri(s3, zoo_cache, tmp_path_factory) -> str:
    """40 texts prepared in 2 shards of 4-sample row groups, on S3."""
    root = tmp_path_factory.mktemp("ranged-data")
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TEXTS), "utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CROSSKD_CACHE_DIR", str(zoo_cache))
        mp.setattr(crosskd.data.shards, "ROW_GROUP_SAMPLES", 4)
        prepare(
            PrepareConfig(
                data=str(root / "data.jsonl"),
                output=str(root / "out"),
                student_tokenizer="zoo:llama3",
                teacher_tokenizers=["zoo:qwen3"],
                max_length=48,
                shard_rows=20,
            ),
            progress=False,
        )
    s3.put(str(root / "out") + "/", f"{BUCKET}/data/", recursive=True)
    return f"s3://{BUCKET}/data"


def _groups(payload: bytes, rows: range) -> list[tuple[int, int]]:
    """Byte ranges of the row groups of Parquet ``payload`` that hold ``rows``."""
    metadata = pq.read_metadata(io.BytesIO(payload))
    bounds = group_bounds(metadata, footer_record(payload)["footer"]["offset"])
    sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [
        (bounds[g], bounds[g + 1])
        for g in range(len(sizes))
        if starts[g] < rows.stop and rows.start < starts[g + 1]
    ]


def _old_format(manifest: dict) -> dict:
    """``manifest`` as written before footers were recorded."""
    return {
        **manifest,
        "shards": [{k: v for k, v in s.items() if k != "footer"} for s in manifest["shards"]],
    }


def _damage(s3, src: str, dst: str, path: str, at: int) -> None:
    """Copy the artifact ``src`` to ``dst`` with byte ``at`` of file ``path`` flipped."""
    s3.copy(src, dst, recursive=True)
    payload = bytearray(s3.cat_file(f"{dst}/{path}"))
    payload[at] ^= 0xFF
    s3.pipe_file(f"{dst}/{path}", bytes(payload))


def test_a_packed_row_costs_its_row_groups_and_the_footer(s3, data_uri, counting):
    data = load_prepared(data_uri)
    entry = data.manifest["shards"][1]
    payload = s3.cat_file(f"{BUCKET}/data/{entry['path']}")
    assert "footer" in entry and pq.read_metadata(io.BytesIO(payload)).num_row_groups >= 4
    rows = PackedRows(data, node_cache=None)
    counting.fetched = 0
    samples, first = rows.row(1, 2)
    needed = _groups(payload, range(first, first + len(samples)))
    assert counting.fetched == entry["footer"]["bytes"] + sum(b - a for a, b in needed)
    assert len(needed) <= 2 and sum(b - a for a, b in needed) < entry["footer"]["offset"] / 2
    whole = PackedRows(PreparedData(data_uri, _old_format(data.manifest)), node_cache=None)
    counting.fetched = 0
    assert whole.row(1, 2) == (samples, first)
    assert counting.fetched == len(payload)


def test_every_packed_row_equals_the_whole_shard_read(s3, data_uri, counting):
    data = load_prepared(data_uri)
    ranged = PackedRows(data, node_cache=None)
    whole = PackedRows(PreparedData(data_uri, _old_format(data.manifest)), node_cache=None)
    sizes = ranged.shard_sizes()
    assert sizes == whole.shard_sizes() and len(sizes) == 2
    order = np.random.default_rng(0).permutation(
        [(s, i) for s, n in enumerate(sizes) for i in range(n)]
    )
    got = []
    counting.fetched = 0
    for shard, index in order.tolist():
        got.append(ranged.row(shard, index))
    # Rows in any order fetch each row group (and the footer) once: the shards' bytes, no more.
    shard_bytes = [s3.size(f"{BUCKET}/data/{s['path']}") for s in data.manifest["shards"]]
    assert counting.fetched == sum(shard_bytes)
    assert got == [whole.row(shard, index) for shard, index in order.tolist()]


def test_a_damaged_row_group_is_refused_when_read(s3, data_uri):
    data = load_prepared(data_uri)
    entry = data.manifest["shards"][0]
    payload = s3.cat_file(f"{BUCKET}/data/{entry['path']}")
    bounds = group_bounds(pq.read_metadata(io.BytesIO(payload)), entry["footer"]["offset"])
    damaged = f"s3://{BUCKET}/damaged-data"
    _damage(
        s3,
        f"{BUCKET}/data",
        f"{BUCKET}/damaged-data",
        entry["path"],
        (bounds[-2] + bounds[-1]) // 2,
    )  # the last row group
    rows = PackedRows(PreparedData(damaged, data.manifest), node_cache=None)
    assert rows.row(0, 0) == PackedRows(data, node_cache=None).row(0, 0)  # not read: not seen
    last = rows.shard_sizes()[0] - 1
    with pytest.raises(DataError) as caught:
        rows.row(0, last)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"prepared data {damaged}: {entry['path']}")
    assert f"row group {len(bounds) - 2} (bytes {bounds[-2]}..{bounds[-1]}) has sha256" in message
    assert message.endswith("its footer says " + message.split("its footer says ")[1])
    assert "the file changed or is damaged. Run `crosskd prepare` again." in message


def test_a_damaged_footer_and_an_old_damaged_shard_are_refused(s3, data_uri):
    data = load_prepared(data_uri)
    entry = data.manifest["shards"][0]
    damaged = f"s3://{BUCKET}/damaged-footer"
    _damage(
        s3,
        f"{BUCKET}/data",
        f"{BUCKET}/damaged-footer",
        entry["path"],
        entry["footer"]["offset"] + 10,
    )
    with pytest.raises(
        DataError,
        match=r"part-000000\.parquet footer \(bytes \d+\.\.\d+\) has "
        r"sha256 \w+, the manifest says",
    ):
        PackedRows(PreparedData(damaged, data.manifest), node_cache=None).row(0, 0)
    old = PackedRows(PreparedData(damaged, _old_format(data.manifest)), node_cache=None)
    with pytest.raises(DataError, match=r"part-000000\.parquet has sha256 \w+, the manifest says"):
        old.row(0, 0)


@pytest.fixture(scope="module")
def cache(s3) -> TeacherCache:
    """Two teacher-cache shards of 10 samples in row groups of 4, on S3, whose manifest records
    each shard's footer (:func:`crosskd.ranges.footer_record`)."""
    rng = np.random.default_rng(0)
    shards = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(crosskd.teacher.storage, "ROW_GROUP_SAMPLES", 4)
        for s in range(2):
            ids, samples = [], []
            for i in range(10):
                n = int(rng.integers(20, 60))
                top = np.sort(rng.choice(1000, size=(n, 8)), axis=1).astype(np.int32)
                samples.append(
                    SampleSignal(
                        top,
                        rng.normal(size=(n, 8)).astype(np.float32),
                        rng.normal(size=n - 1).astype(np.float32),
                        rng.normal(size=n - 1).astype(np.float32),
                    )
                )
                ids.append(f"s{s}-{i}")
            payload = encode(ids, samples, "lossless")
            path = f"part-{s:06d}.parquet"
            s3.pipe_file(f"{BUCKET}/cache/{path}", payload)
            shards.append(
                {
                    "path": path,
                    "samples": 10,
                    "bytes": len(payload),
                    "sha256": hashlib.sha256(payload).hexdigest(),
                    **footer_record(payload),
                }
            )
    manifest = {
        "k": 8,
        "tau": 1.0,
        "encoding": "lossless",
        "shards": shards,
        "teacher": {"vocab_size": 1000},
        "data": {"uri": "s3://somewhere"},
    }
    return TeacherCache(f"s3://{BUCKET}/cache", manifest, node_cache=None)


def test_a_cached_sample_costs_its_row_group_and_equals_the_whole_shard(s3, cache, counting):
    entry = cache.manifest["shards"][1]
    payload = s3.cat_file(f"{BUCKET}/cache/{entry['path']}")
    expected = decode(payload, "lossless", 8)
    ranged = TeacherCache(cache.uri, cache.manifest, node_cache=None)
    counting.fetched = 0
    got = ranged.signal_at(1, 5, "s1-5")
    (group,) = _groups(payload, range(5, 6))
    assert counting.fetched == entry["footer"]["bytes"] + group[1] - group[0]
    assert group[1] - group[0] < entry["footer"]["offset"] / 2
    for row, (sample_id, want) in enumerate(expected):
        got = ranged.signal_at(1, row, sample_id)
        for name in ("ids", "log_probs", "realized", "realized_t1"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    whole = TeacherCache(cache.uri, _old_format(cache.manifest), node_cache=None)
    counting.fetched = 0
    np.testing.assert_array_equal(whole.signal_at(1, 5, "s1-5").ids, expected[5][1].ids)
    assert counting.fetched == len(payload)


def test_a_damaged_cache_row_group_is_refused_when_read(s3, cache):
    entry = cache.manifest["shards"][0]
    payload = s3.cat_file(f"{BUCKET}/cache/{entry['path']}")
    bounds = group_bounds(pq.read_metadata(io.BytesIO(payload)), entry["footer"]["offset"])
    _damage(
        s3,
        f"{BUCKET}/cache",
        f"{BUCKET}/damaged-cache",
        entry["path"],
        (bounds[0] + bounds[1]) // 2,
    )
    damaged = TeacherCache(f"s3://{BUCKET}/damaged-cache", cache.manifest, node_cache=None)
    damaged.signal_at(0, 9, "s0-9")  # the last group: not damaged
    with pytest.raises(
        CacheError,
        match=r"^teacher cache s3://crosskd-test/ranged/damaged-cache: "
        r"part-000000\.parquet row group 0 \(bytes 0\.\.\d+\) "
        r"has sha256 \w+, its footer says \w+; the file changed "
        r"or is damaged\. Delete it and rerun `crosskd score` "
        r"\(completed shards are kept\)\.$",
    ):
        damaged.signal_at(0, 1, "s0-1")
    old = TeacherCache(f"s3://{BUCKET}/damaged-cache", _old_format(cache.manifest))
    with pytest.raises(CacheError, match=r"part-000000\.parquet has sha256 \w+, the manifest"):
        old.signal_at(0, 9, "s0-9")


@pytest.mark.parametrize("artifact", ["data", "cache"])
def test_two_processes_of_a_node_fetch_each_range_once(s3, data_uri, cache, tmp_path, artifact):
    if artifact == "data":
        data = load_prepared(data_uri)
        uri, entry, rows = data_uri, data.manifest["shards"][1], (3, 9)
    else:
        uri, entry, rows = cache.uri, cache.manifest["shards"][1], (3, 9)
    payload = s3.cat_file(f"{uri.removeprefix('s3://')}/{entry['path']}")
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    node = str(tmp_path / "node-cache")
    workers = [
        context.Process(
            target=read_rows,
            args=(uri, entry["path"], entry["footer"], rows, node, barrier, results),
        )
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    got = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
    table = pq.read_table(io.BytesIO(payload)).slice(rows[0], rows[1] - rows[0]).to_pylist()
    assert [values for values, _ in got] == [table, table]
    needed = entry["footer"]["bytes"] + sum(b - a for a, b in _groups(payload, range(*rows)))
    assert sum(fetched for _, fetched in got) == needed
    names = sorted(p.name for p in (tmp_path / "node-cache").iterdir())
    assert len(names) == 1 + len(_groups(payload, range(*rows)))  # no lock or temporary files
    assert entry["footer"]["sha256"] in names and all(len(n) == 64 for n in names)


def test_the_node_cache_keeps_the_most_recently_used_ranges_within_its_bound(tmp_path, monkeypatch):
    """Ranges of 100, 200 and 300 bytes under a bound of 500: each fetched once while kept;
    past the bound the least recently used goes (a hit refreshes a range), and a range that
    went is fetched again. The bound and folder come from the training pod's environment."""
    import os
    import time

    from crosskd.errors import CrosskdError
    from crosskd.ranges import NODE_CACHE_BYTES_ENV, NODE_CACHE_ENV, NodeCache

    monkeypatch.setenv(NODE_CACHE_ENV, str(tmp_path / "node"))
    monkeypatch.setenv(NODE_CACHE_BYTES_ENV, "500")
    cache = NodeCache.from_environment()
    assert cache == NodeCache(str(tmp_path / "node"), 500)
    payloads = {size: bytes([size % 251]) * size for size in (100, 200, 300)}
    digests = {size: hashlib.sha256(p).hexdigest() for size, p in payloads.items()}
    fetched = []

    def get(size: int) -> bytes:
        def download() -> bytes:
            fetched.append(size)
            return payloads[size]

        got = cache.get(digests[size], download)
        time.sleep(0.01)  # distinct modification times
        return got

    assert [get(100), get(200), get(100)] == [payloads[100], payloads[200], payloads[100]]
    assert fetched == [100, 200]
    get(300)  # 600 bytes: the least recently used (200) goes
    assert sorted(os.listdir(tmp_path / "node")) == sorted([digests[100], digests[300]])
    assert get(200) == payloads[200] and fetched == [100, 200, 300, 200]
    monkeypatch.setenv(NODE_CACHE_BYTES_ENV, "20Gi")
    with pytest.raises(CrosskdError, match=r"CROSSKD_NODE_CACHE_BYTES is '20Gi'; it must be"):
        NodeCache.from_environment()
    monkeypatch.delenv(NODE_CACHE_ENV)
    assert NodeCache.from_environment() is None


def test_the_node_cache_stays_right_under_concurrent_fetches_and_evictions(tmp_path):
    """Eight threads (each lock an open file of its own, as processes do) fetch three ranges
    over and over through a cache that holds only one: every read returns the right bytes,
    nobody fails on a lock another removed, and no lock or temporary file is left."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from crosskd.ranges import NodeCache

    cache = NodeCache(str(tmp_path / "node"), max_bytes=150)
    payloads = [bytes([i]) * 100 for i in range(3)]
    digests = [hashlib.sha256(p).hexdigest() for p in payloads]

    def work(worker: int) -> int:
        wrong = 0
        for i in range(40):
            k = (worker + i) % 3
            wrong += cache.get(digests[k], lambda k=k: payloads[k]) != payloads[k]
        return wrong

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(work, range(8))) == 0
    left = os.listdir(tmp_path / "node")
    assert len(left) == 1 and left[0] in digests
