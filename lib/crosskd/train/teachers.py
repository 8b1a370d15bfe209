"""The teacher side of a training run: every input checked against every other before a step.

For each teacher of the prepared data (``teacher0``, ``teacher1``, ...), in config order:

* its tokenizer is loaded from the reference the prepared data recorded and must still have the
  recorded fingerprint (and give each id's UTF-8 length, for ``select`` mode);
* a teacher without tables must share the student's tokenizer
  (:func:`crosskd.loss.config.check_teachers` names the fields that differ), and a teacher the
  data holds as same-tokenizer (not aligned) must have no tables;
* a table pair must have been built for exactly the student's and this teacher's tokenizers
  (:meth:`crosskd.tables.TablePair.check_tokenizers`): a pair built for another tokenizer of the
  same vocabulary size (Qwen2.5 tables with Qwen3 data) would give a silently wrong KD; so
  must the projection of a teacher whose algorithm reads one (``xtoken``, ``gold``, ``hkl``);
* a cache must have been scored on this data with this teacher tokenizer, K and tau
  (:func:`crosskd.teacher.cache.open_cache` refuses anything else), an ``online:REF``
  teacher's tokenizer must be the prepared one, and a teacher server (``http://...`` or
  ``https://...``) must score with the prepared tokenizer, K and tau and take requests as long
  as the prepared teacher capacity (:func:`crosskd.teacher.remote.connect` reads its
  ``/v1/info``).

Online teachers (in the process or a server) are scored by the same code
(:func:`crosskd.teacher.scoring.online_signal`: the batch split into its samples, the signals
laid out as its rows). The signal is computed where :meth:`TeacherSource.signal` is called:
the trainer's input thread (:class:`crosskd.train.loader.Prefetcher`), ``prefetch_steps``
ahead of the step that trains, so a server's requests for steps ``s + 1 .. s +
prefetch_steps`` are on the network while step ``s`` runs (``prefetch_steps: 0`` makes each
step wait for its own).

Every mismatch is a :class:`crosskd.errors.CrosskdError` naming the artifact, the field and
both values.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from crosskd.data.collate import Batch, PreparedData
from crosskd.errors import ConfigError, DataError, TableError
from crosskd.loss.config import PROJECTED, check_teachers
from crosskd.projection import Projection, load_projection
from crosskd.tables import TablePair, load_table_pair
from crosskd.teacher import TeacherSignal
from crosskd.teacher.cache import TeacherCache, open_cache
from crosskd.teacher.model import LoadedTeacher, load_teacher
from crosskd.teacher.remote import ClientOptions, TeacherClient, connect, is_remote
from crosskd.teacher.scoring import online_signal, score_all
from crosskd.tokenization import LoadedTokenizer, load_tokenizer
from crosskd.train.config import TrainConfig

ONLINE = "online:"


@dataclass(frozen=True, eq=False)
class TeacherSource:
    """Where one teacher's signal comes from: a cache, a teacher model run here
    (``online``), or a teacher server (``remote``); exactly one is set."""

    cache: TeacherCache | None
    online: LoadedTeacher | None
    k: int
    tau: float
    remote: TeacherClient | None = None

    def signal(self, batch: Batch, index: int, where: list[tuple[int, int]]) -> TeacherSignal:
        """Teacher ``index``'s signal of the collated ``batch``; ``where``: per packed row, its
        prepared shard and the row of its first sample there (how the cache finds it). From a
        server this is where its requests are made (on the trainer's input thread)."""
        side = batch.models[f"teacher{index}"]
        if self.cache is not None:
            return self.cache.batch(where, batch.sample_ids, side.input_ids.shape[1])
        if self.remote is not None:
            score, vocab_size = self.remote.score, self.remote.info.vocab_size
        else:
            score = partial(score_all, self.online, k=self.k, tau=self.tau, token_budget=4096)
            vocab_size = self.online.vocab_size
        return online_signal(score, side, k=self.k, tau=self.tau, vocab_size=vocab_size)

    def close(self) -> None:
        """Close a teacher server's connections."""
        if self.remote is not None:
            self.remote.close()


@dataclass(frozen=True, eq=False)
class TrainingTeachers:
    """Per teacher: its table ``pairs`` (None: same tokenizer), signal ``sources``,
    ``token_bytes`` (int ``[V_T]``, each id's UTF-8 length) and ``projections`` (``W`` of an
    teacher whose algorithm reads it, else None)."""

    pairs: list[TablePair | None]
    sources: list[TeacherSource]
    token_bytes: list[np.ndarray]
    projections: list[Projection | None]

    def close(self) -> None:
        """Close every teacher server's connections."""
        for source in self.sources:
            source.close()


def load_teachers(
    config: TrainConfig, data: PreparedData, student: LoadedTokenizer, device: torch.device
) -> TrainingTeachers:
    """Load and cross-check every teacher's tokenizer, tables and signal source (see the
    module docstring)."""
    models = {m["name"]: m for m in data.manifest["models"]}
    if len(models) - 1 != len(config.teachers):
        raise ConfigError(
            f"the config has {len(config.teachers)} teacher(s) but {config.data} was prepared "
            f"for {len(models) - 1}; give one teachers[] entry per prepared teacher."
        )
    entries = [models[f"teacher{i}"] for i in range(len(config.teachers))]
    tokenizers = [prepared_tokenizer(config.data, entry) for entry in entries]
    check_teachers(config.loss, student, tokenizers)
    pairs: list[TablePair | None] = []
    for i, (entry, tok) in enumerate(zip(config.loss.teachers, tokenizers, strict=True)):
        if entry.same_tokenizer:
            pairs.append(None)
            continue
        if entries[i].get("same_tokenizer"):
            raise ConfigError(
                f"loss.teachers[{i}] names tables, but {config.data} holds teacher{i} as a "
                f"same-tokenizer teacher (its tokenizer is the student's: no chunks, compared "
                f"position by position); remove student_to_teacher / teacher_to_student."
            )
        pair = load_table_pair(entry.student_to_teacher, entry.teacher_to_student)
        pair.check_tokenizers(student, tok)
        pairs.append(pair)
    projections = [_projection(config, i, student, tok) for i, tok in enumerate(tokenizers)]
    sources: list[TeacherSource] = []
    try:
        for i, ref in enumerate(config.teachers):
            sources.append(_source(config, data, i, ref, entries[i], device))
    except BaseException:
        TrainingTeachers(pairs, sources, [], projections).close()
        raise
    return TrainingTeachers(pairs, sources, [t.bytes.lengths for t in tokenizers], projections)


def _projection(
    config: TrainConfig, i: int, student: LoadedTokenizer, teacher: LoadedTokenizer
) -> Projection | None:
    """Teacher ``i``'s projection (its algorithm reads one; None otherwise), refused unless it
    was built for the student's and this teacher's tokenizers."""
    entry = config.loss.teachers[i]
    if config.loss.algorithm(i) not in PROJECTED:
        return None
    try:
        projection = load_projection(entry.projection)
        projection.check_tokenizers(student, teacher)
    except TableError as exc:
        raise TableError(f"loss.teachers[{i}].projection: {exc}") from None
    return projection


def _source(
    config: TrainConfig, data: PreparedData, i: int, ref: str, entry: dict, device: torch.device
) -> TeacherSource:
    """Teacher ``i``'s signal source (``ref``: its ``teachers`` entry), checked against the
    prepared data's ``entry`` for it."""
    k, tau = config.loss.teachers[i].k, config.loss.tau
    if ref.startswith(ONLINE):
        teacher = load_teacher(ref[len(ONLINE) :], device=device)
        online_tok = load_tokenizer(str(teacher.folder), vocab_size=teacher.vocab_size)
        if online_tok.fingerprint != entry["fingerprint"]:
            raise ConfigError(
                f"teachers[{i}] {ref}: the model's tokenizer has fingerprint "
                f"{online_tok.fingerprint}, but {config.data} was prepared for teacher{i} "
                f"with {entry['fingerprint']} ({entry['tokenizer']}); use the "
                f"teacher the data was prepared for, or prepare the data again."
            )
        return TeacherSource(None, teacher, k, tau)
    if is_remote(ref):
        options = ClientOptions(
            connect_timeout_s=config.teacher_connect_timeout_s,
            read_timeout_s=config.teacher_read_timeout_s,
            retry_s=config.teacher_retry_s,
            concurrency=config.teacher_concurrency,
        )
        client = connect(
            ref,
            tokenizer_fingerprint=entry["fingerprint"],
            k=k,
            tau=tau,
            longest=int(entry["capacity"]),
            options=options,
        )
        return TeacherSource(None, None, k, tau, remote=client)
    cache = open_cache(
        ref,
        tokenizer_fingerprint=entry["fingerprint"],
        data_fingerprint=data.manifest["data_fingerprint"],
        k=k,
        tau=tau,
    )
    return TeacherSource(cache, None, k, tau)


def prepared_tokenizer(uri: str, entry: dict) -> LoadedTokenizer:
    """The tokenizer the prepared data recorded for one model, checked against its recorded
    fingerprint."""
    tok = load_tokenizer(entry["tokenizer"], vocab_size=entry["vocab_size"])
    if tok.fingerprint != entry["fingerprint"]:
        raise DataError(
            f"prepared data {uri}: {entry['name']} was prepared with tokenizer "
            f"{entry['tokenizer']} (fingerprint {entry['fingerprint']}), which now loads a "
            f"tokenizer with fingerprint {tok.fingerprint}; prepare the data again."
        )
    return tok
