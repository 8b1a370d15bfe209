"""Reading a teacher cache back (written by :func:`crosskd.teacher.scoring.score`).

:func:`open_cache` reads the manifest and refuses a cache whose teacher, tokenizer or data
fingerprint, K or tau is not what the training config asks for, naming the field and both
values. :meth:`TeacherCache.shard` reads one shard in order (sequential access);
:meth:`TeacherCache.sample` finds one sample by id (random access: the manifest indexes every
sample, and the ``keep_shards`` most recently used decoded shards are kept). Every shard's
sha256 is checked against the manifest when it is read. :meth:`TeacherCache.batch` assembles
the signal of a collated batch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from crosskd.artifacts import read_checked, read_manifest
from crosskd.errors import CrosskdError
from crosskd.teacher.scoring import FORMAT_VERSION, KIND
from crosskd.teacher.signal import SignalError, TeacherSignal
from crosskd.teacher.storage import SampleSignal, batch_signal, decode


class CacheError(CrosskdError):
    """A teacher cache is missing, damaged, or not the one the config asks for."""


@dataclass
class TeacherCache:
    """An open teacher cache: ``uri`` and its ``manifest``."""

    uri: str
    manifest: dict
    keep_shards: int = 8
    """Decoded shards kept in memory for :meth:`sample` (least recently used dropped first)."""
    _loaded: OrderedDict[int, dict[str, SampleSignal]] = field(
        default_factory=OrderedDict, repr=False
    )

    @property
    def k(self) -> int:
        """The stored top-K size."""
        return int(self.manifest["k"])

    @property
    def tau(self) -> float:
        """The temperature of the stored log probs."""
        return float(self.manifest["tau"])

    def shard(self, index: int) -> list[tuple[str, SampleSignal]]:
        """The samples of shard ``index`` in order, after checking its sha256."""
        payload = read_checked(
            self.uri, self.manifest["shards"][index], what="teacher cache", error=CacheError,
            rebuild="Delete it and rerun `crosskd score` (completed shards are kept).",
        )  # fmt: skip
        return decode(payload, self.manifest["encoding"], self.k)

    def sample(self, sample_id: str) -> SampleSignal:
        """The signal of one sample by id."""
        where = self.manifest["samples"].get(sample_id)
        if where is None:
            raise CacheError(
                f"teacher cache {self.uri} has no sample {sample_id!r}; it was scored from "
                f"{self.manifest['data']['uri']} — score the data you train on."
            )
        index, _ = where
        if index in self._loaded:
            self._loaded.move_to_end(index)
        else:
            self._loaded[index] = dict(self.shard(index))
            while len(self._loaded) > self.keep_shards:
                self._loaded.popitem(last=False)
        return self._loaded[index][sample_id]

    def batch(self, sample_ids: list[list[str]], width: int) -> TeacherSignal:
        """The signal of a collated batch: ``sample_ids`` per packed row (``Batch.sample_ids``),
        ``width`` the teacher's padded row length."""
        rows = [[self.sample(s) for s in row] for row in sample_ids]
        return batch_signal(rows, width, k=self.k, tau=self.tau,
                            vocab_size=int(self.manifest["teacher"]["vocab_size"]))  # fmt: skip


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
        uri, what="teacher cache", kind=KIND, versions=(FORMAT_VERSION,), error=CacheError,
        rebuild="`crosskd score` (it resumes)",
    )  # fmt: skip
    recorded = {
        "teacher fingerprint": manifest["teacher"]["fingerprint"],
        "tokenizer fingerprint": manifest["tokenizer"]["fingerprint"],
        "data fingerprint": manifest["data"]["fingerprint"],
        "k": manifest["k"],
        "tau": manifest["tau"],
    }
    wanted = {
        "teacher fingerprint": teacher_fingerprint, "tokenizer fingerprint": tokenizer_fingerprint,
        "data fingerprint": data_fingerprint, "k": k, "tau": None if tau is None else float(tau),
    }  # fmt: skip
    for name, want in wanted.items():
        if want is not None and recorded[name] != want:
            raise SignalError(
                f"teacher cache {uri}: {name} is {recorded[name]}, the config asks for {want}; "
                f"score the teacher again for this config (or change the config to match)."
            )
    return TeacherCache(uri, manifest)
