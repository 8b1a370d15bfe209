"""Dataset readers: one :class:`Record` per row of a JSON Lines, Parquet or Hugging Face
``datasets`` source, local or behind any fsspec URI, with a durable ``sample_id``.

Sources (the ``uri`` of :func:`read_records`):

* a ``.jsonl`` or ``.json`` file in JSON Lines form: one JSON object per line, UTF-8 (a BOM is
  allowed), blank lines skipped;
* a ``.parquet`` file;
* a folder written by ``datasets.Dataset.save_to_disk``: its Arrow stream files are read with
  pyarrow in the order its ``state.json`` lists them (the ``datasets`` package is not needed);
* a folder or a glob of ``.jsonl``/``.json``/``.parquet`` shards, read in sorted name order
  (names starting with ``.`` or ``_`` and crosskd's own ``manifest.json`` are skipped).

Rows: a row holds either a text value (a non-empty string; whitespace-only is allowed) or a
messages value (a non-empty list of ``{"role", "content"}`` objects with an optional
``reasoning_content``, at least one of them with role ``assistant``), never both. The column
names are options. Messages are normalized to exactly these keys (other keys, and a null
``reasoning_content``, are dropped), so a conversation reads the same from every format.

Sample ids: the id column's value (a string or an integer) as a string where the row has one;
otherwise the first 16 hex digits of the sha256 of the canonical JSON (sorted keys, compact,
UTF-8, no ASCII escapes) of ``[base name of the source file, copy, content]``, where
``content`` is ``{"text": ...}`` or ``{"messages": ...}`` (messages as normalized below) and
``copy`` counts the earlier rows of the same file with identical content. Such an id does
not depend on the row's position, so it is the same after the rows of a file are shuffled, after
the file is read from another folder, bucket or mount point, and after a read is resumed; it
changes when the shard is renamed or the row's content is edited. Ids are unique within one
read: a repeated id is an error naming both rows.

Positions: :attr:`Record.row` is the 1-based line number in a JSON Lines file and the 0-based row
index in a Parquet or Arrow file (what editors and pyarrow show); error messages use the same.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from crosskd.errors import DataError

__all__ = ["Record", "duplicate_id_message", "read_records"]

_SHARD_SUFFIXES = (".jsonl", ".json", ".parquet")
_GLOB_CHARS = frozenset("*?[")
_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Record:
    """One row of a dataset: exactly one of ``text`` and ``messages`` is set.

    ``source`` is the file the row came from (a local path or a URI) and ``row`` its position
    there (1-based line of a JSON Lines file, 0-based row of a Parquet or Arrow file).
    """

    sample_id: str
    text: str | None
    messages: list[dict] | None
    source: str
    row: int


@dataclass(frozen=True)
class _Columns:
    text: str
    messages: str
    id: str | None


@dataclass(frozen=True)
class _Where:
    source: str
    unit: str
    row: int

    def __str__(self) -> str:
        return f"{self.source} {self.unit} {self.row}"


def read_records(
    uri: str,
    *,
    text_column: str = "text",
    messages_column: str = "messages",
    id_column: str | None = "id",
    unique_ids: bool = True,
) -> Iterator[Record]:
    """Yield the rows of the dataset at ``uri`` (a file, folder, glob or datasets folder; local
    path or fsspec URI) as :class:`Record` objects, in file order.

    ``id_column=None`` ignores any id column and derives every id from the content.
    ``unique_ids=False`` leaves out the check that ids are unique (it keeps every id read in
    memory; ``crosskd prepare`` checks uniqueness when it merges its shards instead). Raises
    :class:`~crosskd.errors.DataError`, naming the file and line or row, for a source that
    does not exist or has an unsupported format, and for any malformed row.
    """
    columns = _Columns(text_column, messages_column, id_column)
    first_use: dict[str, _Where] = {}
    for fs, path, kind in _resolve(uri):
        source = _display(fs, path)
        copies: dict[bytes, int] = {}
        for row, values, names in _rows(fs, path, kind, source, columns):
            where = _Where(source, "line" if kind == "jsonl" else "row", row)
            record = _to_record(values, names, where, columns, copies)
            if not unique_ids:
                yield record
                continue
            first = first_use.setdefault(record.sample_id, where)
            if first is not where:
                raise DataError(_duplicate_message(record.sample_id, first, where, values, columns))
            yield record


def _resolve(uri: str) -> list[tuple[fsspec.AbstractFileSystem, str, str]]:
    """The files behind ``uri`` with their kind (``jsonl``, ``parquet`` or ``arrow``)."""
    fs, path = fsspec.core.url_to_fs(uri)
    if _GLOB_CHARS.intersection(path):
        paths = [p for p in sorted(fs.glob(path)) if _is_shard(p) and fs.isfile(p)]
        if not paths:
            raise DataError(
                f"{uri}: the pattern matches no .jsonl, .json or .parquet file; check the pattern"
            )
        return [(fs, p, _kind(p, uri)) for p in paths]
    if fs.isdir(path):
        return [(fs, p, k) for p, k in _folder_files(fs, path, uri)]
    if fs.isfile(path):
        return [(fs, path, _kind(path, uri))]
    raise DataError(f"{uri}: no such file or folder; check the path or URI")


def _folder_files(fs: fsspec.AbstractFileSystem, path: str, uri: str) -> list[tuple[str, str]]:
    names = {posixpath.basename(p.rstrip("/")): p for p in fs.ls(path, detail=False)}
    if "dataset_dict.json" in names:
        splits = sorted(n for n, p in names.items() if fs.isdir(p))
        raise DataError(
            f"{uri}: a datasets DatasetDict folder (splits {splits}); pass one split's folder, "
            f"for example {uri.rstrip('/')}/{splits[0] if splits else 'train'}"
        )
    if "state.json" in names:
        with fs.open(names["state.json"], "rb") as f:
            state = json.load(f)
        files = [entry["filename"] for entry in state.get("_data_files", [])]
        files = files or sorted(n for n in names if n.endswith(".arrow"))
        if not files:
            raise DataError(f"{uri}: a datasets folder without Arrow files; save it again")
        return [(posixpath.join(path, name), "arrow") for name in files]
    shards = sorted(p for n, p in names.items() if _is_shard(n) and fs.isfile(p))
    if not shards:
        raise DataError(
            f"{uri}: the folder holds no .jsonl, .json or .parquet file and is not a datasets "
            f"folder (found {sorted(names)[:10]}); pass a data file, a shard folder or a glob"
        )
    return [(p, _kind(p, uri)) for p in shards]


def _is_shard(path: str) -> bool:
    name = posixpath.basename(path)
    return name.endswith(_SHARD_SUFFIXES) and name[0] not in "._" and name != "manifest.json"


def _kind(path: str, uri: str) -> str:
    if path.endswith((".jsonl", ".json")):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    raise DataError(
        f"{uri}: unsupported file type; crosskd reads .jsonl/.json (JSON Lines), .parquet, "
        "datasets folders (save_to_disk) and folders or globs of such shards"
    )


def _display(fs: fsspec.AbstractFileSystem, path: str) -> str:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return path if "file" in protocols else fs.unstrip_protocol(path)


def _rows(
    fs: fsspec.AbstractFileSystem, path: str, kind: str, source: str, columns: _Columns
) -> Iterator[tuple[int, dict, Iterable[str]]]:
    """``(row, values, column names present)`` for every row of one file."""
    if kind == "jsonl":
        yield from _jsonl_rows(fs, path, source)
        return
    wanted = [c for c in (columns.text, columns.messages, columns.id) if c is not None]
    with fs.open(path, "rb") as f:
        try:
            if kind == "parquet":
                parquet = pq.ParquetFile(f)
                names = parquet.schema_arrow.names
                present = _present(wanted, names, source, columns)
                batches: Iterable = parquet.iter_batches(batch_size=_BATCH_ROWS, columns=present)
            else:
                stream = pa.ipc.open_stream(f)
                names = stream.schema.names
                present = _present(wanted, names, source, columns)
                batches = (batch.select(present) for batch in stream)
            yield from _batch_rows(batches, names)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(
                f"{source}: cannot be read as {kind.capitalize()} ({exc}); check that the file "
                "is complete and of the type its name says"
            ) from None


def _present(wanted: list[str], names: list[str], source: str, columns: _Columns) -> list[str]:
    if columns.text not in names and columns.messages not in names:
        raise DataError(_missing_message(names, source, columns))
    return [c for c in wanted if c in names]


def _batch_rows(batches: Iterable, names: list[str]) -> Iterator[tuple[int, dict, list[str]]]:
    row = 0
    for batch in batches:
        values = {name: batch.column(name).to_pylist() for name in batch.schema.names}
        for i in range(batch.num_rows):
            yield row, {name: column[i] for name, column in values.items()}, names
            row += 1


def _jsonl_rows(
    fs: fsspec.AbstractFileSystem, path: str, source: str
) -> Iterator[tuple[int, dict, Iterable[str]]]:
    with fs.open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{source} line {number}"
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{where}: invalid UTF-8 at byte {exc.start} of the line "
                    f"({raw[exc.start : exc.start + 4]!r}); re-encode the file as UTF-8 "
                    "(for example `iconv -f latin1 -t utf-8`) or drop the line"
                ) from None
            if not line.strip():
                continue
            try:
                value = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where}: malformed JSON ({exc.msg}, column {exc.colno}); every line must "
                    f"be one complete JSON object{_array_hint(line)}"
                ) from None
            if not isinstance(value, dict):
                raise DataError(
                    f"{where}: a JSON {type(value).__name__}, not an object; every line must be "
                    f"one JSON object{_array_hint(line)}"
                )
            yield number, value, value.keys()


def _array_hint(line: str) -> str:
    if line.lstrip().startswith("["):
        return " (this looks like a JSON array; convert it with `jq -c '.[]' in.json > out.jsonl`)"
    return ""


def _to_record(
    values: dict, names: Iterable[str], where: _Where, columns: _Columns, copies: dict[bytes, int]
) -> Record:
    text = values.get(columns.text)
    messages = values.get(columns.messages)
    if text is None and messages is None:
        raise DataError(_missing_message(names, where, columns))
    if text is not None and messages is not None:
        raise DataError(
            f"{where}: has both a {columns.text!r} and a {columns.messages!r} value; keep one "
            "(or point text_column / messages_column at the one to use)"
        )
    if text is not None:
        _check_text(text, where, columns.text)
        content: dict = {"text": text}
    else:
        messages = _check_messages(messages, where, columns.messages)
        content = {"messages": messages}
    sample_id = _given_id(values, where, columns.id)
    if sample_id is None:
        key = hashlib.sha256(_canonical(content).encode()).digest()
        copy = copies.get(key, 0)
        copies[key] = copy + 1
        base = posixpath.basename(where.source)
        sample_id = hashlib.sha256(_canonical([base, copy, content]).encode()).hexdigest()[:16]
    return Record(sample_id, text, messages, where.source, where.row)


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _missing_message(names: Iterable[str], where: _Where | str, columns: _Columns) -> str:
    names = sorted(names)
    if columns.text in names or columns.messages in names:
        return (
            f"{where}: both {columns.text!r} and {columns.messages!r} are null; give the row a "
            "text or messages value, or drop it"
        )
    return (
        f"{where}: no {columns.text!r} or {columns.messages!r} column (columns: {names}); set "
        "text_column or messages_column to the column that holds the text or conversation"
    )


def _check_text(text: object, where: _Where, column: str) -> None:
    if not isinstance(text, str):
        raise DataError(
            f"{where}: {column!r} is a {type(text).__name__}, not a string; store the text as a "
            "string, or set messages_column if it is a conversation"
        )
    if not text:
        raise DataError(f"{where}: {column!r} is an empty string; drop the row")
    _check_unicode(text, where, repr(column))


def _check_unicode(text: str, where: _Where, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(
            f"{where}: {what} holds a lone surrogate U+{ord(text[exc.start]):04X} at character "
            f"{exc.start} (a broken \\u escape); fix the escape or drop the row"
        ) from None


def _check_messages(value: object, where: _Where, column: str) -> list[dict]:
    shape = "a non-empty list of {role, content} objects"
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {column!r} must be {shape}, not {_describe(value)}; fix the row")
    messages = []
    for i, message in enumerate(value):
        what = f"{column!r} message {i}"
        if not isinstance(message, dict):
            raise DataError(f"{where}: {what} is {_describe(message)}; {column!r} must be {shape}")
        role, content = message.get("role"), message.get("content")
        reasoning = message.get("reasoning_content")
        if not isinstance(role, str) or not role:
            raise DataError(f"{where}: {what} has no string 'role' (got {_describe(role)})")
        if not isinstance(content, str):
            raise DataError(
                f"{where}: {what} ({role}) has no string 'content' (got {_describe(content)}); "
                "give every message a string content"
            )
        if reasoning is not None and not isinstance(reasoning, str):
            raise DataError(
                f"{where}: {what} ({role}) has a 'reasoning_content' that is "
                f"{_describe(reasoning)}, not a string; fix or remove it"
            )
        clean = {"role": role, "content": content}
        if reasoning is not None:
            clean["reasoning_content"] = reasoning
        for key, part in clean.items():
            if key != "role":
                _check_unicode(part, where, f"{what} {key}")
        messages.append(clean)
    if not any(m["role"] == "assistant" for m in messages):
        roles = [m["role"] for m in messages]
        raise DataError(
            f"{where}: the conversation has no assistant message (roles {roles}), so there is "
            "nothing to distil; drop the row or fix its roles"
        )
    return messages


def _given_id(values: dict, where: _Where, column: str | None) -> str | None:
    if column is None:
        return None
    given = values.get(column)
    if given is None:
        return None
    if isinstance(given, str) and given:
        return given
    if isinstance(given, int) and not isinstance(given, bool):
        return str(given)
    raise DataError(
        f"{where}: id column {column!r} holds {_describe(given)}; use a non-empty string or "
        "an integer, or set id_column=None to derive ids from the content"
    )


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _duplicate_message(
    sample_id: str, first: _Where, again: _Where, values: dict, columns: _Columns
) -> str:
    given = columns.id is not None and values.get(columns.id) is not None
    return duplicate_id_message(sample_id, str(first), str(again), columns.id if given else None)


def duplicate_id_message(sample_id: str, first: str, again: str, id_column: str | None) -> str:
    """The error for a sample id read twice: ``first`` and ``again`` say where (``FILE line N``
    or ``FILE row N``); ``id_column`` is the column the id came from (None: a content hash)."""
    if id_column is not None:
        fix = f"make the {id_column!r} column unique, or set id_column=None to derive ids"
    else:
        fix = "two shards with the same base name hold the same row; rename one of them"
    return (
        f"{again}: sample id {sample_id!r} was already used by {first}; sample ids must be "
        f"unique within one read: {fix}"
    )
