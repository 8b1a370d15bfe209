"""The wire protocol of ``crosskd serve``: what a client sends and what the teacher server
answers (HTTP/1.1, JSON requests, Parquet answers), checked on both sides.

Endpoints (every ``/v1/`` one needs ``Authorization: Bearer <token>``):

* ``GET /v1/info``: JSON :class:`ServerInfo`, the teacher, its tokenizer's fingerprint, ``V``,
  the K, tau and encoding every answer has, and the most tokens one request may hold.
* ``POST /v1/score``: a JSON :class:`ScoreRequest`, the teacher token ids of one or more
  sequences (what ``crosskd prepare`` aligned), or texts the server tokenizes with the teacher's
  tokenizer (no special tokens added). The answer (200, ``Content-Type``
  :data:`PARQUET`) is the Parquet file :func:`crosskd.teacher.storage.encode` writes for a
  cache shard, one row per sequence in request order (ids ``"0"``, ``"1"``, ...), so a
  client decodes it as the cache reader does; for texts it also has a ``tokens`` column, each
  row's token ids (int32).
* ``GET /healthz`` (the process answers), ``GET /readyz`` (the teacher is loaded and the
  server is not draining), ``GET /metrics`` (Prometheus): no token.

Errors are JSON ``{"error": "<one line naming the field, what is wrong, what to do>"}``: 400
malformed request, 401 missing or wrong token, 404 no such endpoint, 413 more tokens than
``max_request_tokens``, 429 the queue is full and 503 draining or not ready (both with
``Retry-After`` seconds: try again, or another replica).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from crosskd.errors import CrosskdError

VERSION = 1
"""Protocol version; :class:`ServerInfo` carries it and a client refuses any other."""
PARQUET = "application/vnd.apache.parquet"
"""``Content-Type`` of a score answer."""
JSON = "application/json"
"""``Content-Type`` of requests, ``/v1/info`` and errors."""


class RequestError(CrosskdError):
    """A request the server refuses; ``status`` is the HTTP status it answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServerInfo:
    """What a teacher server scores with; every answer has exactly this K, tau and encoding."""

    teacher: str
    """The teacher model's reference (as ``crosskd serve`` was given it)."""
    model_fingerprint: str
    """The teacher model's fingerprint (:class:`crosskd.teacher.model.LoadedTeacher`)."""
    tokenizer_fingerprint: str
    """The fingerprint of the teacher's tokenizer (:class:`crosskd.tokenization.
    LoadedTokenizer`): a client compares it with the one its prepared data recorded."""
    vocab_size: int
    """``V``: the teacher's output-layer rows; every token id must be below it."""
    k: int
    """The top-K size of each token's answer."""
    tau: float
    """The temperature of the answered top-K log probs."""
    encoding: str
    """``lossless`` or ``lossy`` (:data:`crosskd.teacher.storage.ENCODINGS`)."""
    max_request_tokens: int
    """The most tokens (summed over the sequences) one request may hold."""
    version: int = VERSION
    """The protocol version."""

    def to_json(self) -> bytes:
        """The ``/v1/info`` body."""
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, body: bytes, where: str) -> ServerInfo:
        """Parse a ``/v1/info`` body from ``where`` (the server's URL, for errors).

        Raises:
            CrosskdError: Not JSON, a field missing or of the wrong type, another version.
        """
        try:
            values = json.loads(body)
            info = cls(**values)
        except (ValueError, TypeError) as exc:
            raise CrosskdError(
                f"teacher server {where}: /v1/info is not a crosskd teacher server's answer "
                f"({exc}); check the URL."
            ) from None
        if info.version != VERSION:
            raise CrosskdError(
                f"teacher server {where} speaks protocol version {info.version}; this crosskd "
                f"speaks {VERSION}: run the same crosskd version on both sides."
            )
        return info


@dataclass(frozen=True)
class ScoreRequest:
    """One ``/v1/score`` request: ``sequences`` (teacher token ids, int ``[L_i]`` each) or
    ``texts``, never both; ``k``, ``tau`` and ``tokenizer_fingerprint`` are what the client
    expects (checked by the server when given)."""

    sequences: list[np.ndarray] | None = None
    texts: list[str] | None = None
    k: int | None = None
    tau: float | None = None
    tokenizer_fingerprint: str | None = None

    def to_json(self) -> bytes:
        """The request body."""
        values: dict = {}
        if self.sequences is not None:
            values["sequences"] = [np.asarray(s).tolist() for s in self.sequences]
        if self.texts is not None:
            values["texts"] = list(self.texts)
        for key in ("k", "tau", "tokenizer_fingerprint"):
            if getattr(self, key) is not None:
                values[key] = getattr(self, key)
        return json.dumps(values, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, body: bytes) -> ScoreRequest:
        """Parse and check a request body (shapes and types only; :meth:`check` compares it
        with the server).

        Raises:
            RequestError: (400) not a JSON object, an unknown key, neither or both of
                ``sequences`` and ``texts``, an empty list, a sequence that is not a non-empty
                list of integers, a text that is not a non-empty string, ``k`` not an integer
                >= 1, ``tau`` not a finite number > 0.
        """
        try:
            values = json.loads(body)
        except ValueError as exc:
            raise RequestError(f"the body is not JSON ({exc}); send a JSON object.") from None
        if not isinstance(values, dict):
            raise RequestError('the body is not a JSON object; send {"sequences": [[...]]}.')
        known = {"sequences", "texts", "k", "tau", "tokenizer_fingerprint"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise RequestError(
                f"unknown key(s) {', '.join(unknown)}; a request has {', '.join(sorted(known))}."
            )
        if ("sequences" in values) == ("texts" in values):
            raise RequestError("send exactly one of 'sequences' (token ids) and 'texts'.")
        sequences = texts = None
        if "sequences" in values:
            sequences = _sequences(values["sequences"])
        else:
            texts = _texts(values["texts"])
        k, tau = values.get("k"), values.get("tau")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise RequestError(f"k is {k!r}; it must be an integer >= 1.")
        if tau is not None and (
            isinstance(tau, bool)
            or not isinstance(tau, int | float)
            or not math.isfinite(tau)
            or tau <= 0
        ):
            raise RequestError(f"tau is {tau!r}; it must be a finite number > 0.")
        fingerprint = values.get("tokenizer_fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise RequestError(f"tokenizer_fingerprint is {fingerprint!r}; it must be a string.")
        return cls(sequences, texts, k, None if tau is None else float(tau), fingerprint)

    def check(self, info: ServerInfo) -> None:
        """Refuse a request this server cannot answer as asked.

        Raises:
            RequestError: (400) ``k``, ``tau`` or ``tokenizer_fingerprint`` given and not the
                server's; a token id outside ``0 .. V - 1``; (413) more than
                ``max_request_tokens`` tokens of sequences.
        """
        for key in ("k", "tau", "tokenizer_fingerprint"):
            asked, served = getattr(self, key), getattr(info, key)
            if asked is not None and asked != served:
                raise RequestError(
                    f"{key} is {asked!r}; this server answers with {key} = {served!r}: ask a "
                    f"server started with {key} = {asked!r}."
                )
        if self.sequences is None:
            return
        tokens = sum(len(s) for s in self.sequences)
        if tokens > info.max_request_tokens:
            raise RequestError(
                f"the request holds {tokens} tokens; this server takes at most "
                f"{info.max_request_tokens} per request: split it.",
                413,
            )
        for i, seq in enumerate(self.sequences):
            low, high = int(seq.min()), int(seq.max())
            if low < 0 or high >= info.vocab_size:
                raise RequestError(
                    f"sequences[{i}] holds token ids from {low} to {high}; the teacher's "
                    f"vocabulary is 0 .. {info.vocab_size - 1}: send ids of its tokenizer."
                )


def _sequences(value: object) -> list[np.ndarray]:
    """``sequences`` of a request: a non-empty list of non-empty lists of integers."""
    if not isinstance(value, list) or not value:
        raise RequestError("sequences must be a non-empty list of lists of token ids.")
    out = []
    for i, seq in enumerate(value):
        if (
            not isinstance(seq, list)
            or not seq
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in seq)
        ):
            raise RequestError(f"sequences[{i}] must be a non-empty list of integer token ids.")
        out.append(np.asarray(seq, dtype=np.int64))
    return out


def _texts(value: object) -> list[str]:
    """``texts`` of a request: a non-empty list of non-empty strings."""
    if not isinstance(value, list) or not value:
        raise RequestError("texts must be a non-empty list of strings.")
    for i, text in enumerate(value):
        if not isinstance(text, str) or not text:
            raise RequestError(f"texts[{i}] must be a non-empty string.")
    return list(value)


def error_body(message: str) -> bytes:
    """The JSON body of an error answer."""
    return json.dumps({"error": message}).encode()


def error_message(body: bytes) -> str:
    """The message of an error answer's body (the body itself, shortened, when it is not one of
    ours)."""
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")


def with_tokens(payload: bytes, tokens: list[np.ndarray]) -> bytes:
    """The Parquet answer ``payload`` with a ``tokens`` column (each row's token ids, int32)."""
    table = pq.read_table(pa.BufferReader(payload))
    column = pa.array([np.asarray(t, dtype=np.int32) for t in tokens], pa.list_(pa.int32()))
    sink = pa.BufferOutputStream()
    pq.write_table(table.append_column("tokens", column), sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def answer_tokens(payload: bytes) -> list[np.ndarray]:
    """The ``tokens`` column of a texts answer: each text's token ids (int64)."""
    column = pq.read_table(pa.BufferReader(payload), columns=["tokens"]).column("tokens")
    return [np.asarray(row, dtype=np.int64) for row in column.to_pylist()]
