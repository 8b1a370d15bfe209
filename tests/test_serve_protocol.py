"""The teacher server's wire protocol (:mod:`crosskd.serve.protocol`): requests and server info
survive their JSON round trips, every malformed request is refused (400, or 413 for too many
tokens) with a message naming what is wrong, and a texts answer carries each text's tokens
beside signals that decode as a cache shard's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from crosskd.errors import CrosskdError
from crosskd.serve.protocol import (
    VERSION,
    RequestError,
    ScoreRequest,
    ServerInfo,
    answer_tokens,
    error_body,
    error_message,
    with_tokens,
)
from crosskd.teacher.storage import SampleSignal, decode, encode

INFO = ServerInfo(
    teacher="zoo:tiny",
    model_fingerprint="m" * 64,
    tokenizer_fingerprint="t" * 64,
    vocab_size=300,
    k=8,
    tau=2.0,
    encoding="lossless",
    max_request_tokens=20,
)


def test_server_info_round_trips():
    assert ServerInfo.from_json(INFO.to_json(), "http://x") == INFO
    assert json.loads(INFO.to_json())["version"] == VERSION


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"<html>not json</html>", "is not a crosskd teacher server's answer"),
        (b"[1, 2]", "is not a crosskd teacher server's answer"),
        (json.dumps({"teacher": "x"}).encode(), "missing"),
        (INFO.to_json()[:-1] + b', "extra": 1}', "unexpected keyword argument 'extra'"),
    ],
)
def test_server_info_refuses_what_is_not_one(body, words):
    with pytest.raises(CrosskdError, match="teacher server http://x") as caught:
        ServerInfo.from_json(body, "http://x")
    assert words in str(caught.value)
    assert "check the URL" in str(caught.value)


def test_server_info_refuses_another_protocol_version():
    other = json.loads(INFO.to_json()) | {"version": VERSION + 1}
    with pytest.raises(CrosskdError, match=f"speaks protocol version {VERSION + 1}"):
        ServerInfo.from_json(json.dumps(other).encode(), "http://x")


def test_score_requests_round_trip():
    sequences = [np.array([1, 2, 3]), np.array([299])]
    request = ScoreRequest(sequences, k=8, tau=2.0, tokenizer_fingerprint="t" * 64)
    back = ScoreRequest.from_json(request.to_json())
    assert [s.tolist() for s in back.sequences] == [[1, 2, 3], [299]]
    assert all(s.dtype == np.int64 for s in back.sequences)
    assert (back.texts, back.k, back.tau, back.tokenizer_fingerprint) == (None, 8, 2.0, "t" * 64)
    texts = ScoreRequest.from_json(ScoreRequest(texts=["a b", "ü"]).to_json())
    assert (texts.sequences, texts.texts, texts.k, texts.tau) == (None, ["a b", "ü"], None, None)
    assert json.loads(ScoreRequest(texts=["x"]).to_json()) == {"texts": ["x"]}
    assert ScoreRequest.from_json(b'{"sequences": [[1]], "tau": 1}').tau == 1.0


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"{not json", "the body is not JSON"),
        (b"", "the body is not JSON"),
        (b"[[1, 2]]", "the body is not a JSON object"),
        (b'"text"', "the body is not a JSON object"),
        (b'{"sequences": [[1]], "top_k": 8}', "unknown key(s) top_k"),
        (b"{}", "send exactly one of 'sequences' (token ids) and 'texts'"),
        (b'{"sequences": [[1]], "texts": ["a"]}', "send exactly one of"),
        (b'{"sequences": []}', "sequences must be a non-empty list"),
        (b'{"sequences": [1, 2]}', "sequences[0] must be a non-empty list of integer"),
        (b'{"sequences": [[1], []]}', "sequences[1] must be a non-empty list of integer"),
        (b'{"sequences": [[1, 2.0]]}', "sequences[0] must be a non-empty list of integer"),
        (b'{"sequences": [[1, true]]}', "sequences[0] must be a non-empty list of integer"),
        (b'{"sequences": [["1"]]}', "sequences[0] must be a non-empty list of integer"),
        (b'{"sequences": "1 2 3"}', "sequences must be a non-empty list"),
        (b'{"texts": []}', "texts must be a non-empty list of strings"),
        (b'{"texts": "abc"}', "texts must be a non-empty list of strings"),
        (b'{"texts": ["a", ""]}', "texts[1] must be a non-empty string"),
        (b'{"texts": [3]}', "texts[0] must be a non-empty string"),
        (b'{"sequences": [[1]], "k": 0}', "k is 0; it must be an integer >= 1"),
        (b'{"sequences": [[1]], "k": 8.0}', "k is 8.0; it must be an integer >= 1"),
        (b'{"sequences": [[1]], "k": true}', "k is True; it must be an integer >= 1"),
        (b'{"sequences": [[1]], "tau": 0}', "tau is 0; it must be a finite number > 0"),
        (b'{"sequences": [[1]], "tau": -1.5}', "tau is -1.5; it must be a finite number"),
        (b'{"sequences": [[1]], "tau": NaN}', "tau is nan; it must be a finite number"),
        (b'{"sequences": [[1]], "tau": Infinity}', "tau is inf; it must be a finite number"),
        (b'{"sequences": [[1]], "tau": "1"}', "tau is '1'; it must be a finite number"),
        (b'{"sequences": [[1]], "tau": false}', "tau is False; it must be a finite number"),
        (b'{"sequences": [[1]], "tokenizer_fingerprint": 7}', "tokenizer_fingerprint is 7"),
    ],
)
def test_malformed_requests_are_refused_with_their_reason(body, words):
    with pytest.raises(RequestError) as caught:
        ScoreRequest.from_json(body)
    assert caught.value.status == 400
    assert words in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("request_", "status", "words"),
    [
        (ScoreRequest([np.array([1])], k=16), 400, "k is 16; this server answers with k = 8"),
        (ScoreRequest([np.array([1])], tau=1.0), 400, "tau is 1.0; this server answers with"),
        (
            ScoreRequest([np.array([1])], tokenizer_fingerprint="u" * 64),
            400,
            "tokenizer_fingerprint is 'uuuu",
        ),
        (ScoreRequest(texts=["a"], k=4), 400, "k is 4; this server answers with k = 8"),
        (
            ScoreRequest([np.arange(15), np.arange(6)]),
            413,
            "the request holds 21 tokens; this server takes at most 20 per request: split it",
        ),
        (
            ScoreRequest([np.array([1]), np.array([5, 300])]),
            400,
            "sequences[1] holds token ids from 5 to 300; the teacher's vocabulary is 0 .. 299",
        ),
        (ScoreRequest([np.array([-1, 3])]), 400, "sequences[0] holds token ids from -1 to 3"),
    ],
)
def test_requests_the_server_cannot_answer_are_refused(request_, status, words):
    with pytest.raises(RequestError) as caught:
        request_.check(INFO)
    assert caught.value.status == status
    assert words in str(caught.value)


def test_requests_the_server_can_answer_pass():
    ScoreRequest([np.arange(10), np.arange(290, 300)], k=8, tau=2.0).check(INFO)
    ScoreRequest(texts=["a" * 1000], tokenizer_fingerprint="t" * 64).check(INFO)  # tokens later


def _signal(length: int, k: int, seed: int) -> SampleSignal:
    gen = np.random.default_rng(seed)
    ids = np.sort(gen.choice(300, size=(length, k), replace=True), axis=1).astype(np.int32)
    return SampleSignal(
        ids,
        gen.normal(size=(length, k)).astype(np.float32),
        gen.normal(size=length - 1).astype(np.float32),
        gen.normal(size=length - 1).astype(np.float32),
    )


def test_a_texts_answer_carries_each_texts_tokens():
    signals = [_signal(4, 8, 0), _signal(1, 8, 1)]
    tokens = [np.array([7, 8, 9, 10]), np.array([299])]
    payload = with_tokens(encode(["0", "1"], signals, "lossless"), tokens)
    assert [t.tolist() for t in answer_tokens(payload)] == [[7, 8, 9, 10], [299]]
    assert all(t.dtype == np.int64 for t in answer_tokens(payload))
    decoded = decode(payload, "lossless", 8)
    assert [name for name, _ in decoded] == ["0", "1"]
    for (_, got), want in zip(decoded, signals, strict=True):
        assert np.array_equal(got.ids, want.ids)
        assert np.array_equal(got.log_probs, want.log_probs)
        assert np.array_equal(got.realized, want.realized)


def test_error_bodies_round_trip_and_foreign_ones_are_shown():
    assert error_message(error_body("k is 3; ...")) == "k is 3; ..."
    assert error_message(b"<html>502 Bad Gateway</html>") == "<html>502 Bad Gateway</html>"
    assert error_message(b'{"detail": "x"}') == '{"detail": "x"}'
    assert len(error_message(b"x" * 1000)) == 200
