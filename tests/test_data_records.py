"""Dataset readers: every format, local and through fsspec, durable ids, and bad input."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections import Counter
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crosskd.data import Record, read_records
from crosskd.errors import DataError

TEXTS = ["alpha", "  \t ", "世界 e\u0301 👍🏽\r\nend", "alpha"]
CONVERSATIONS = [
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because.", "reasoning_content": "Think first."},
    ],
]
MESSAGE_ROWS = [{"id": f"c{i}", "messages": m} for i, m in enumerate(CONVERSATIONS, start=1)]
FORMATS = ["jsonl", "parquet", "datasets", "shards", "glob"]


@pytest.fixture
def memory_root():
    """A fresh ``memory://`` folder, removed afterwards (the memory store is process-wide)."""
    root = f"memory:///crosskd-test-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path, memory_root) -> str:
    """Where a test writes its dataset: a local folder or a memory:// URI."""
    return str(tmp_path) if request.param == "local" else memory_root


def _put(uri: str, payload: bytes) -> None:
    with fsspec.open(uri, "wb") as f:
        f.write(payload)


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def _parquet(rows: list[dict]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


def _write(fmt: str, rows: list[dict], root: str, tmp_path: Path) -> str:
    """Write ``rows`` under ``root`` in format ``fmt``; return the URI to read."""
    if fmt == "jsonl":
        _put(f"{root}/data.jsonl", _jsonl(rows))
        return f"{root}/data.jsonl"
    if fmt == "parquet":
        _put(f"{root}/data.parquet", _parquet(rows))
        return f"{root}/data.parquet"
    if fmt == "datasets":
        import datasets

        local = tmp_path / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(local), num_shards=2)
        if root.startswith("memory://"):
            fsspec.filesystem("memory").put(str(local), f"{root}/saved", recursive=True)
            return f"{root}/saved"
        return str(local)
    half = len(rows) // 2
    _put(f"{root}/shards/part-0.jsonl", _jsonl(rows[:half]))
    _put(f"{root}/shards/part-1.parquet", _parquet(rows[half:]))
    _put(f"{root}/shards/manifest.json", b'{"kind": "not data"}')
    _put(f"{root}/shards/_SUCCESS", b"")
    return f"{root}/shards" if fmt == "shards" else f"{root}/shards/part-*"


@pytest.mark.parametrize("fmt", FORMATS)
def test_text_rows_read_alike_in_every_format(fmt, root, tmp_path):
    records = list(read_records(_write(fmt, [{"text": t} for t in TEXTS], root, tmp_path)))
    assert [r.text for r in records] == TEXTS
    assert all(r.messages is None for r in records)
    assert len({r.sample_id for r in records}) == len(TEXTS)
    assert all(len(r.sample_id) == 16 and int(r.sample_id, 16) >= 0 for r in records)
    if fmt in ("jsonl", "parquet"):
        assert {r.source for r in records} == {f"{root}/data.{fmt}"}
        assert [r.row for r in records] == ([1, 2, 3, 4] if fmt == "jsonl" else [0, 1, 2, 3])
    if fmt in ("shards", "glob"):
        assert [(Path(r.source).name, r.row) for r in records] == [
            ("part-0.jsonl", 1),
            ("part-0.jsonl", 2),
            ("part-1.parquet", 0),
            ("part-1.parquet", 1),
        ]
    if fmt == "datasets":
        assert [(Path(r.source).name, r.row) for r in records] == [
            ("data-00000-of-00002.arrow", 0),
            ("data-00000-of-00002.arrow", 1),
            ("data-00001-of-00002.arrow", 0),
            ("data-00001-of-00002.arrow", 1),
        ]


@pytest.mark.parametrize("fmt", FORMATS)
def test_messages_rows_read_alike_in_every_format(fmt, root, tmp_path):
    records = list(read_records(_write(fmt, MESSAGE_ROWS, root, tmp_path)))
    # Arrow gives every message every struct field; a null reasoning_content is dropped again.
    assert [r.messages for r in records] == CONVERSATIONS
    assert [r.sample_id for r in records] == ["c1", "c2"]
    assert all(r.text is None for r in records)


def test_derived_id_is_the_documented_hash(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(_jsonl([{"text": "alpha"}, {"text": "beta"}, {"text": "alpha"}]))
    ids = [r.sample_id for r in read_records(str(path))]

    def expected(canonical: str) -> str:
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    assert ids == [
        expected('["data.jsonl",0,{"text":"alpha"}]'),
        expected('["data.jsonl",0,{"text":"beta"}]'),
        expected('["data.jsonl",1,{"text":"alpha"}]'),
    ]


def test_ids_survive_another_mount_point_and_ignore_position(tmp_path, memory_root):
    rows = [{"text": t} for t in TEXTS]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "data.jsonl").write_bytes(_jsonl(rows))
    _put(f"{memory_root}/elsewhere/data.jsonl", _jsonl([{"other": 1, **r} for r in rows]))
    local = list(read_records(str(tmp_path / "a" / "data.jsonl")))
    remote = list(read_records(f"{memory_root}/elsewhere/data.jsonl"))
    assert [r.sample_id for r in local] == [r.sample_id for r in remote]
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_bytes(_jsonl(rows))
    assert {r.sample_id for r in read_records(str(renamed))}.isdisjoint(r.sample_id for r in local)


@settings(max_examples=40, deadline=None)
@given(
    texts=st.lists(
        st.one_of(st.sampled_from(["a", "b", " ", "ü\u0308"]), st.text(min_size=1, max_size=12)),
        min_size=1,
        max_size=25,
    ),
    data=st.data(),
)
def test_ids_are_distinct_and_stable_under_shuffling(texts, data):
    order = data.draw(st.permutations(range(len(texts))))
    root = f"memory:///crosskd-test-{uuid.uuid4().hex}"
    try:
        _put(f"{root}/one/data.jsonl", _jsonl([{"text": t} for t in texts]))
        _put(f"{root}/two/data.jsonl", _jsonl([{"text": texts[i]} for i in order]))
        first = list(read_records(f"{root}/one/data.jsonl"))
        second = list(read_records(f"{root}/two/data.jsonl"))
    finally:
        fsspec.filesystem("memory").rm(root, recursive=True)
    assert len({r.sample_id for r in first}) == len(texts)
    # Identical texts are interchangeable, so the (text, id) pairs must match as a multiset.
    assert Counter((r.text, r.sample_id) for r in first) == Counter(
        (r.text, r.sample_id) for r in second
    )


def test_configurable_columns_blank_lines_and_bom(tmp_path):
    path = tmp_path / "custom.json"
    path.write_bytes(
        b"\xef\xbb\xbf"
        + json.dumps({"uid": 7, "body": "x"}).encode()
        + b"\n\n   \n"
        + json.dumps({"uid": "k", "body": "y", "id": "ignored"}).encode()
        + b"\r\n"
    )
    records = list(read_records(str(path), text_column="body", id_column="uid"))
    assert records == [
        Record("7", "x", None, str(path), 1),
        Record("k", "y", None, str(path), 4),
    ]
    hashed = list(read_records(str(path), text_column="body", id_column=None))
    assert all(len(r.sample_id) == 16 and r.sample_id not in ("7", "k") for r in hashed)


BAD_JSONL = [
    (
        b'{"body": "x"}\n',
        r"line 1: no 'text' or 'messages' column \(columns: \['body'\]\); set "
        r"text_column",
    ),
    (b'{"text": "ok"}\n{"text": ""}\n', r"line 2: 'text' is an empty string"),
    (b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n', r"line 3: invalid UTF-8 at byte 13 .*re-encode"),
    (b'{"text": "ok"}\n{"text": "open}\n', r"line 2: malformed JSON \(Unterminated string"),
    (b'[{"text": "a"}]\n', r"line 1: a JSON list, not an object.*JSON array.*jq"),
    (b'[\n{"text": "a"}\n]\n', r"line 1: malformed JSON.*JSON array"),
    (b'{"text": 5}\n', r"line 1: 'text' is a int, not a string"),
    (b'{"text": null}\n', r"line 1: both 'text' and 'messages' are null"),
    (b'{"text": "a", "messages": []}\n', r"line 1: has both a 'text' and a 'messages' value"),
    (b'{"text": "bad \\ud800 escape"}\n', r"line 1: 'text' holds a lone surrogate U\+D800"),
    (b'{"messages": "hi"}\n', r"line 1: 'messages' must be a non-empty list of \{role, content"),
    (b'{"messages": []}\n', r"line 1: 'messages' must be a non-empty list"),
    (b'{"messages": ["hi"]}\n', r"line 1: 'messages' message 0 is str 'hi'"),
    (b'{"messages": [{"content": "x"}]}\n', r"line 1: 'messages' message 0 has no string 'role'"),
    (
        b'{"messages": [{"role": "assistant", "content": 3}]}\n',
        r"line 1: 'messages' message 0 \(assistant\) has no string 'content' \(got int 3\)",
    ),
    (
        b'{"messages": [{"role": "assistant", "content": "", "reasoning_content": 1}]}\n',
        r"line 1: 'messages' message 0 \(assistant\) has a 'reasoning_content' that is int 1",
    ),
    (
        b'{"messages": [{"role": "user", "content": "hi"}]}\n',
        r"line 1: the conversation has no assistant message \(roles \['user'\]\)",
    ),
    (b'{"id": 1.5, "text": "x"}\n', r"line 1: id column 'id' holds float 1.5; use a non-empty"),
    (
        b'{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n{"id": "a", "text": "z"}\n',
        r"line 3: sample id 'a' was already used by .*data.jsonl line 1; .*make the 'id' column",
    ),
]


@pytest.mark.parametrize(("payload", "pattern"), BAD_JSONL)
def test_bad_jsonl_rows_are_named_by_file_and_line(payload, pattern, root):
    uri = f"{root}/data.jsonl"
    _put(uri, payload)
    with pytest.raises(DataError, match=pattern) as caught:
        list(read_records(uri))
    assert str(caught.value).startswith(f"{uri} line ")


def test_duplicate_derived_ids_across_same_named_shards(tmp_path):
    for sub in ("x", "y"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "data.jsonl").write_bytes(_jsonl([{"text": "same"}]))
    with pytest.raises(DataError, match=r"y/data.jsonl line 1: .*x/data.jsonl line 1; .*rename"):
        list(read_records(str(tmp_path / "*" / "data.jsonl")))


def test_bad_parquet_rows_are_named_by_file_and_row(root):
    uri = f"{root}/data.parquet"
    _put(uri, _parquet([{"body": "x"}]))
    with pytest.raises(
        DataError,
        match=r"data.parquet: no 'text' or 'messages' column \(columns: "
        r"\['body'\]\); set text_column",
    ):
        list(read_records(uri))
    _put(uri, _parquet([{"text": "ok"}, {"text": ""}]))
    with pytest.raises(DataError, match=r"data.parquet row 1: 'text' is an empty string"):
        list(read_records(uri))
    _put(uri, b"PAR1 not really parquet")
    with pytest.raises(DataError, match=r"data.parquet: cannot be read as Parquet"):
        list(read_records(uri))


def test_bad_sources_are_named(tmp_path):
    import datasets

    with pytest.raises(DataError, match=r"missing.jsonl: no such file or folder"):
        list(read_records(str(tmp_path / "missing.jsonl")))
    (tmp_path / "data.csv").write_text("text\nx\n")
    with pytest.raises(DataError, match=r"data.csv: unsupported file type; crosskd reads .jsonl"):
        list(read_records(str(tmp_path / "data.csv")))
    with pytest.raises(DataError, match=r"holds no .jsonl, .json or .parquet file .*data.csv"):
        list(read_records(str(tmp_path)))
    with pytest.raises(DataError, match=r"nothing-\*.jsonl: the pattern matches no"):
        list(read_records(str(tmp_path / "nothing-*.jsonl")))
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}])})
    splits.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"DatasetDict folder \(splits \['train'\]\); pass one "):
        list(read_records(str(tmp_path / "dict")))
    assert [r.text for r in read_records(str(tmp_path / "dict" / "train"))] == ["a"]
