"""The byte view of token ids (spec section 1).

``bytes(i)`` of a normal token inverts the GPT-2 ByteLevel byte-to-unicode map over the token's
string; it is defined for tokens whose bytes are not valid UTF-8 on their own. The byte view of
a whole vocabulary is a :class:`ByteVocab` (CSR arrays), so byte comparisons are vectorised.
Keeping this behind one module lets a SentencePiece byte-fallback view be added later.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

import numpy as np

from crosskd import ragged

KIND_NONE, KIND_NORMAL, KIND_SPECIAL = 0, 1, 2
"""Values of :attr:`ByteVocab.kind`: no token (a padding row), a normal token, a special."""


def _byte_level_alphabet() -> dict[int, str]:
    """The GPT-2 ByteLevel map: byte value -> the printable character that stands for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


BYTE_TO_CHAR: Mapping[int, str] = MappingProxyType(_byte_level_alphabet())
# str.translate table from alphabet characters to byte values. Characters below 256 that are not
# in the alphabet map to U+0100, outside latin-1, so a string holding them fails to encode
# instead of yielding wrong bytes.
_CHAR_TO_BYTE_TABLE: Mapping[int, int] = MappingProxyType(
    {b: 0x100 for b in range(256)} | {ord(c): b for b, c in BYTE_TO_CHAR.items()}
)


def byte_level_to_bytes(token: str) -> bytes | None:
    """Bytes a ByteLevel token string stands for, or None if it has a character outside the
    ByteLevel alphabet."""
    try:
        return token.translate(_CHAR_TO_BYTE_TABLE).encode("latin-1")
    except UnicodeEncodeError:
        return None


def bytes_to_byte_level(data: bytes) -> str:
    """The ByteLevel string of ``data`` (one alphabet character per byte)."""
    return data.decode("latin-1").translate(BYTE_TO_CHAR)


@dataclass(frozen=True, eq=False)
class ByteVocab:
    """The byte view of ids ``[0, V)`` in CSR form.

    ``data`` uint8 ``[total bytes]``; ``offsets`` int64 ``[V + 1]``: the bytes of id ``i`` are
    ``data[offsets[i]:offsets[i + 1]]``; ``kind`` uint8 ``[V]``: :data:`KIND_NONE`,
    :data:`KIND_NORMAL` or :data:`KIND_SPECIAL`.
    """

    data: np.ndarray
    offsets: np.ndarray
    kind: np.ndarray

    def __len__(self) -> int:
        return len(self.kind)

    def token_bytes(self, token_id: int) -> bytes:
        """bytes(i); empty for a padding row."""
        return self.data[self.offsets[token_id] : self.offsets[token_id + 1]].tobytes()

    @cached_property
    def lengths(self) -> np.ndarray:
        """Byte length of every id, int64 ``[V]``."""
        return np.diff(self.offsets)

    @cached_property
    def digits(self) -> np.ndarray:
        """Whether each id is spelled by ASCII digits ``0``-``9`` alone (one or more), bool
        ``[V]``: the tokens of a number's digits."""
        is_digit = (self.data >= ord("0")) & (self.data <= ord("9"))
        others = np.concatenate([[0], np.cumsum(~is_digit)])  # non-digit bytes before each byte
        return (others[self.offsets[1:]] == others[self.offsets[:-1]]) & (self.lengths > 0)

    def concat(self, ids: np.ndarray) -> np.ndarray:
        """The bytes of ``ids`` (int ``[n]``) one after another, uint8 ``[sum of lengths]``."""
        return self.data[ragged.select(self.offsets, ids)]
