"""Held-out text dense in multi-digit numbers, made here: worked arithmetic in short sentences.

The uncommon-token case of a tokenizer pair: SmolLM2 (the teacher) spells a number digit by
digit, Llama-3 (the moved student) packs up to three digits in one token, so a 1:1 chunk never
holds a number of more than one digit and every such number is a 1:n chunk (CSD: a chain;
X-Token: the projection's first-piece rows; gold: no exact match). The text is sentences such
as "Ada has 347 stamps and buys 1289 more, so Ada has 1636 stamps." with every result right,
so a model that can add scores better on the results' digits than one that cannot. The same
``seed`` gives the same documents on every machine; no step of any arm trains on them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ("Ada", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas")
ITEMS = ("stamps", "apples", "books", "bolts", "tickets", "crates", "coins", "seeds")


def _sentence(rng: random.Random) -> str:
    """One sentence of worked arithmetic, its result right."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(10, 9999), rng.randint(10, 9999)
    small, factor = rng.randint(2, 99), rng.randint(2, 999)
    kind = rng.randrange(6)
    if kind == 0:
        return f"{name} has {a} {item} and buys {b} more, so {name} has {a + b} {item}."
    if kind == 1:
        high, low = max(a, b), min(a, b)
        return f"{name} had {high} {item}, sold {low} and kept {high - low}."
    if kind == 2:
        return f"A box holds {small} {item}; {factor} boxes hold {small * factor} {item}."
    if kind == 3:
        return f"{small * factor} {item} shared by {factor} people is {small} each."
    if kind == 4:
        op = rng.choice("+-x")
        value = a + b if op == "+" else a - b if op == "-" else small * factor
        left = f"{small} x {factor}" if op == "x" else f"{a} {op} {b}"
        return f"{left} = {value}."
    start = rng.randint(1200, 1990)
    end = rng.randint(start + 1, 2025)
    return f"From {start} to {end} is {end - start} years."


def arithmetic_documents(
    target_bytes: int, *, document_bytes: int = 384, seed: int = 0
) -> list[str]:
    """About ``target_bytes`` UTF-8 bytes of documents of sentences (module docstring), each
    at least ``document_bytes`` bytes long; stops at the first document that reaches the
    target."""
    rng = random.Random(seed)
    documents: list[str] = []
    total = 0
    while total < target_bytes:
        sentences: list[str] = []
        while len(" ".join(sentences)) < document_bytes:
            sentences.append(_sentence(rng))
        document = " ".join(sentences)
        documents.append(document)
        total += len(document.encode("utf-8"))
    return documents


def write_rows(path: Path, target_bytes: int) -> Path:
    """:func:`arithmetic_documents` as JSONL text rows (``{"id", "text"}``) at ``path``, written
    once; returns ``path``."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = (
            json.dumps({"id": f"numbers-{i}", "text": text})
            for i, text in enumerate(arithmetic_documents(target_bytes))
        )
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(f"{row}\n" for row in rows))
        tmp.replace(path)
    return path
