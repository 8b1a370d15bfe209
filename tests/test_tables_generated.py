"""Tables between tokenizers trained in the test, over many generated corpora (hypothesis)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from crosskd.tables import Flag, TablePair, build_table, validate_pair
from crosskd.tokenization import KIND_NORMAL, load_tokenizer

ALPHABET = "abcdefgh xyz\n\t.,!?0123éüß日本語✓👍\u0301"


def _train(folder: Path, corpus: list[str], vocab_size: int, full_alphabet: bool) -> Path:
    """A ByteLevel BPE trained on ``corpus``; without the full alphabet some bytes have no token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if full_alphabet else [],
    )
    tok.train_from_iterator(corpus, trainer)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"})
    )
    return folder


def _vocab_and_ranks(folder: Path) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """Vocabulary and merge ranks read straight from tokenizer.json."""
    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], {pair: rank for rank, pair in enumerate(merges)}


def _reference_bpe(word: str, vocab: dict[str, int], ranks: dict) -> list[str]:
    """Textbook BPE, independent of the tokenizers library: drop characters the vocabulary
    lacks, then merge the adjacent pair of lowest rank (leftmost first) until none is left."""
    symbols = [c for c in word if c in vocab]
    while len(symbols) > 1:
        best = min(
            range(len(symbols) - 1),
            key=lambda k: (ranks.get((symbols[k], symbols[k + 1]), len(ranks)), k),
        )
        if (symbols[best], symbols[best + 1]) not in ranks:
            break
        symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
    return symbols


corpora = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=40), min_size=3, max_size=30)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    corpus_a=corpora,
    corpus_b=corpora,
    size_a=st.integers(270, 420),
    size_b=st.integers(270, 420),
    full_a=st.booleans(),
    full_b=st.booleans(),
    pad_rows=st.integers(0, 5),
)
def test_generated_pairs(
    tmp_path_factory, corpus_a, corpus_b, size_a, size_b, full_a, full_b, pad_rows
):
    root = tmp_path_factory.mktemp("pair")
    a_dir = _train(root / "a", corpus_a, size_a, full_a)
    b_dir = _train(root / "b", corpus_b, size_b, full_b)
    a = load_tokenizer(a_dir)
    b = load_tokenizer(b_dir, vocab_size=len(load_tokenizer(b_dir).hf) + pad_rows)
    a2b, b2a = build_table(a, b, progress=False), build_table(b, a, progress=False)
    assert [r.violations for r in validate_pair(a, b, a2b, b2a)] == [[], []]
    assert a2b.flag_counts()["padding"] == 0 and b2a.flag_counts()["padding"] == pad_rows

    for src, table, dst_dir in ((a, a2b, b_dir), (b, b2a, a_dir)):
        vocab, ranks = _vocab_and_ranks(dst_dir)
        for i in np.flatnonzero(src.bytes.kind == KIND_NORMAL).tolist():
            word = src.hf.convert_ids_to_tokens(i)
            pieces = _reference_bpe(word, vocab, ranks)
            reference = [vocab[p] for p in pieces]
            # Both sides spell bytes in the same ByteLevel alphabet: equal strings, equal bytes.
            exact = "".join(pieces) == word
            if exact:
                assert table.flags[i] == Flag.NORMAL
                assert table.chain(i).tolist() == reference
            else:
                assert table.flags[i] == Flag.UNREPRESENTABLE
                assert table.chain(i).size == 0

    pair = TablePair(a2b, b2a)
    strings_a, strings_b = a.hf.get_vocab(), b.hf.get_vocab()
    shared = sorted(
        (i, strings_b[w])
        for w, i in strings_a.items()
        if w in strings_b
        and a.bytes.kind[i] == KIND_NORMAL == b.bytes.kind[strings_b[w]]
        and a2b.chain(i).tolist() == [strings_b[w]]
        and b2a.chain(strings_b[w]).tolist() == [i]
    )
    assert pair.common.tolist() == [list(p) for p in shared]
