"""Reading a teacher cache back (written by :func:`crosskd.teacher.scoring.score_shards`, its
manifest by :func:`crosskd.teacher.scoring.merge_cache`).

:func:`open_cache` reads the manifest and refuses a cache whose teacher, tokenizer or data
fingerprint, K or tau is not what the training config asks for, naming the field and both
values. Cache shard ``i`` holds the signals of prepared shard ``i``'s samples in the same order,
so a sample is found by its place in the prepared data (shard, row), never through an index of
every sample id. :meth:`TeacherCache.shard` reads one shard whole (its sha256 checked) and
decodes it in order (sequential access); :meth:`TeacherCache.open_shard` opens one and keeps
the ``keep_shards`` most recently used, decoding a sample only when it is asked for
(:meth:`TeacherCache.signal_at`; ``reads`` counts the opens per shard). A shard whose manifest
entry records its footer (:mod:`crosskd.ranges`) is opened by byte ranges: its footer, checked
against the manifest, then only the row groups of the samples asked for, each checked against
the footer (with a node cache the processes of a node fetch each range once); one without (an
older cache) is read whole and its sha256 checked.
:meth:`TeacherCache.batch` assembles the signal of a collated batch.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from crosskd.artifacts import read_manifest
from crosskd.errors import CrosskdError
from crosskd.ranges import ArtifactFile, NodeCache, open_parquet
from crosskd.teacher.scoring import KIND
from crosskd.teacher.signal import SignalError, TeacherSignal
from crosskd.teacher.storage import CacheShard, SampleSignal, batch_signal, decode

FORMAT_VERSIONS = (1, 2)
"""Version 1 also indexed every sample id in the manifest (not read any more)."""
REBUILD = "Delete it and rerun `crosskd score` (completed shards are kept)."


class CacheError(CrosskdError):
    """A teacher cache is missing, damaged, or not the one the config asks for."""


@dataclass
class TeacherCache:
    """An open teacher cache: ``uri`` and its ``manifest``."""

    uri: str
    manifest: dict
    keep_shards: int = 16
    """Shards kept open (least recently used dropped first)."""
    node_cache: NodeCache | None = field(default_factory=NodeCache.from_environment)
    """Node-local folder remote byte ranges are shared through (:mod:`crosskd.ranges`;
    default: ``CROSSKD_NODE_CACHE``, None: not shared)."""
    reads: Counter = field(default_factory=Counter, repr=False)
    """How many times each shard was opened (for the data-loading figures)."""
    _open: OrderedDict[int, CacheShard] = field(default_factory=OrderedDict, repr=False)

    @property
    def k(self) -> int:
        """The stored top-K size."""
        return int(self.manifest["k"])

    @property
    def tau(self) -> float:
        """The temperature of the stored log probs."""
        return float(self.manifest["tau"])

    def _file(self, index: int) -> ArtifactFile:
        return ArtifactFile(
            self.uri,
            self.manifest["shards"][index]["path"],
            "teacher cache",
            CacheError,
            REBUILD,
            self.node_cache,
        )

    def shard(self, index: int) -> list[tuple[str, SampleSignal]]:
        """The samples of shard ``index`` in order, after checking its sha256 (read whole)."""
        payload = self._file(index).fetch(None, None, self.manifest["shards"][index]["sha256"])
        return decode(payload, self.manifest["encoding"], self.k)

    def open_shard(self, index: int) -> CacheShard:
        """Shard ``index`` opened (kept among the ``keep_shards`` most recent): by byte ranges
        when its manifest entry records its footer, else read whole and checked."""
        if index in self._open:
            self._open.move_to_end(index)
            return self._open[index]
        shards = self.manifest["shards"]
        if not 0 <= index < len(shards):
            raise CacheError(
                f"teacher cache {self.uri} has {len(shards)} shards, not shard {index}; it was "
                f"scored from {self.manifest['data']['uri']}: score the data you train on."
            )
        self.reads[index] += 1
        source = open_parquet(self._file(index), shards[index])
        self._open[index] = CacheShard(source, self.manifest["encoding"], self.k)
        while len(self._open) > self.keep_shards:
            self._open.popitem(last=False)
        return self._open[index]

    def signal_at(self, shard: int, row: int, sample_id: str) -> SampleSignal:
        """The signal of the sample at ``row`` of prepared shard ``shard``, which must be
        ``sample_id`` (else the cache is not of this data)."""
        opened = self.open_shard(shard)
        if row >= len(opened) or opened.sample_id(row) != sample_id:
            found = opened.sample_id(row) if row < len(opened) else "nothing"
            raise CacheError(
                f"teacher cache {self.uri}: shard {shard} row {row} holds {found!r}, the "
                f"prepared data has {sample_id!r} there; it was scored from "
                f"{self.manifest['data']['uri']}: score the data you train on."
            )
        return opened.signal(row)

    def batch(
        self, where: list[tuple[int, int]], sample_ids: list[list[str]], width: int
    ) -> TeacherSignal:
        """The signal of a collated batch: per packed row its prepared shard and the row of its
        first sample there (its samples follow one another), ``sample_ids`` per packed row
        (``Batch.sample_ids``), ``width`` the teacher's padded row length."""
        rows = [
            [self.signal_at(shard, first + i, s) for i, s in enumerate(ids)]
            for (shard, first), ids in zip(where, sample_ids, strict=True)
        ]
        return batch_signal(
            rows,
            width,
            k=self.k,
            tau=self.tau,
            vocab_size=int(self.manifest["teacher"]["vocab_size"]),
        )


def open_cache(
    uri: str,
    *,
    teacher_fingerprint: str | None = None,
    tokenizer_fingerprint: str | None = None,
    data_fingerprint: str | None = None,
    k: int | None = None,
    tau: float | None = None,
) -> TeacherCache:
    """Open the cache at ``uri``, refusing one that does not match the given values (None: not
    checked)."""
    manifest = read_manifest(
        uri,
        what="teacher cache",
        kind=KIND,
        versions=FORMAT_VERSIONS,
        error=CacheError,
        rebuild="`crosskd score` (it resumes)",
    )
    recorded = {
        "teacher fingerprint": manifest["teacher"]["fingerprint"],
        "tokenizer fingerprint": manifest["tokenizer"]["fingerprint"],
        "data fingerprint": manifest["data"]["fingerprint"],
        "k": manifest["k"],
        "tau": manifest["tau"],
    }
    wanted = {
        "teacher fingerprint": teacher_fingerprint,
        "tokenizer fingerprint": tokenizer_fingerprint,
        "data fingerprint": data_fingerprint,
        "k": k,
        "tau": None if tau is None else float(tau),
    }
    for name, want in wanted.items():
        if want is not None and recorded[name] != want:
            raise SignalError(
                f"teacher cache {uri}: {name} is {recorded[name]}, the config asks for {want}; "
                f"score the teacher again for this config (or change the config to match)."
            )
    return TeacherCache(uri, manifest)
