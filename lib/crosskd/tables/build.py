"""Building one direction ``src -> dst`` of a sub-token table (spec section 3).

* Normal src tokens: the chain is the dst BPE model exactly as configured applied to bytes(i)
  as one word (no normalizer, no pre-tokenizer), complete, never truncated. If the result's
  bytes differ from bytes(i) (the dst vocabulary lacks a byte, and its BPE silently drops it),
  the row is flagged ``UNREPRESENTABLE`` with an empty chain.
* Specials: mapped by role to the dst special with the same role (``SPECIAL_MAPPED``, a chain of
  one id) or ``SPECIAL_UNMAPPED`` (empty chain) when the dst has no such role.
* Ids in ``[0, V_src)`` that are no token: ``PADDING``, empty chain.
"""

from __future__ import annotations

import logging

import numpy as np

from crosskd import ragged
from crosskd.tables.format import Flag, SubTokenTable, TableMeta, roles_json
from crosskd.tokenization import KIND_NORMAL, KIND_SPECIAL, ByteVocab, LoadedTokenizer

log = logging.getLogger(__name__)


def build_table(
    src: LoadedTokenizer,
    dst: LoadedTokenizer,
    *,
    progress: bool = True,
) -> SubTokenTable:
    """Build the table ``src -> dst`` for every src id in ``[0, V_src)``.

    Args:
        src, dst: the two tokenizers (``V`` of each is its ``vocab_size``).
        progress: show a tqdm bar over the src vocabulary.
    """
    v_src = src.vocab_size
    flags = np.full(v_src, Flag.PADDING, dtype=np.uint8)
    normal = np.flatnonzero(src.bytes.kind == KIND_NORMAL)
    normal_offsets, normal_chains = dst_chains(src, dst, normal, progress=progress)
    exact = chains_match_bytes(src.bytes, normal, dst.bytes, normal_offsets, normal_chains)
    flags[normal] = np.where(exact, Flag.NORMAL, Flag.UNREPRESENTABLE)

    specials = np.flatnonzero(src.bytes.kind == KIND_SPECIAL)
    special_dst = np.array(
        [dst.role_ids.get(src.roles.get(i, ""), -1) for i in specials.tolist()], dtype=np.int64
    )
    flags[specials] = np.where(special_dst >= 0, Flag.SPECIAL_MAPPED, Flag.SPECIAL_UNMAPPED)

    lengths = np.zeros(v_src, dtype=np.int64)
    lengths[normal[exact]] = np.diff(normal_offsets)[exact]
    lengths[specials[special_dst >= 0]] = 1
    offsets = ragged.offsets_from_lengths(lengths)
    chains = np.empty(int(offsets[-1]), dtype=np.int32)
    kept = np.flatnonzero(exact)
    kept_values = normal_chains[ragged.select(normal_offsets, kept)]
    chains[ragged.select(offsets, normal[kept])] = kept_values
    mapped = special_dst >= 0
    chains[offsets[specials[mapped]]] = special_dst[mapped]
    meta = TableMeta(
        src_name=src.name,
        dst_name=dst.name,
        src_fingerprint=src.fingerprint,
        dst_fingerprint=dst.fingerprint,
        src_len=src.length,
        dst_len=dst.length,
        src_vocab_size=v_src,
        dst_vocab_size=dst.vocab_size,
        src_roles=roles_json(src),
        dst_roles=roles_json(dst),
    )
    table = SubTokenTable(offsets=offsets, chains=chains, flags=flags, meta=meta)
    log.info("built %s -> %s: %s", src.name, dst.name, table.flag_counts())
    return table


def dst_chains(
    src: LoadedTokenizer, dst: LoadedTokenizer, rows: np.ndarray, *, progress: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The dst BPE of the normal src tokens ``rows`` (int ``[n]``), each as one word: CSR
    ``(offsets int64 [n + 1], dst ids int32)``, before any exactness check."""
    strings = src.token_strings
    desc = f"chains {_short(src.name)} -> {_short(dst.name)}" if progress else None
    return dst.encode_byte_level([strings[i] for i in rows.tolist()], desc=desc)


def chains_match_bytes(
    src: ByteVocab,
    rows: np.ndarray,
    dst: ByteVocab,
    offsets: np.ndarray,
    chains: np.ndarray,
) -> np.ndarray:
    """For each src id in ``rows`` (int ``[n]``), whether the concatenated bytes of its chain
    equal its own bytes, vectorised.

    ``offsets`` int64 ``[n + 1]`` and ``chains`` (dst ids) are the CSR chains of ``rows`` in
    order. Returns bool ``[n]``.
    """
    rows = np.asarray(rows, dtype=np.int64)
    src_offsets = ragged.offsets_from_lengths(src.lengths[rows])
    chain_byte_ends = ragged.offsets_from_lengths(dst.lengths[chains])
    return ragged.segments_equal(
        src.concat(rows), src_offsets, dst.concat(chains), chain_byte_ends[offsets]
    )


def _short(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1]
