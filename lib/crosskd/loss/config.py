"""The loss configuration (spec sections 5 and 6): what is compared, how it is weighted, and
how several teachers combine.

:class:`LossConfig` checks every value when it is built (from YAML through
:func:`crosskd.config.load_config`, or in code) and refuses a bad one with a
:class:`~crosskd.errors.ConfigError` naming the key (``teachers[1].k``, ``divergence``, ...).
:func:`check_teachers` then checks the config against the tokenizers it will run with: a
teacher without tables is a *same-tokenizer* teacher, which needs the student's tokenizer; if
the fingerprints differ the error lists the fields that differ.

Top-K (``k > 0``) and dense (``k = 0``) signals are different objectives: the top K leaves the
teacher's tail to REST. ``keep_realized`` changes the objective even when K covers the
vocabulary (the realized event is then in E even where the teacher's top K does not reach it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from crosskd.errors import ConfigError
from crosskd.loss.divergence import DIVERGENCES
from crosskd.loss.events import CsdOptions
from crosskd.loss.kernels import KERNELS
from crosskd.tokenization import LoadedTokenizer, fingerprint_fields

TEACHER_MODES = ("sum", "select", "average")
KD_METHODS = ("csd", "uld", "xtoken", "gold", "hkl")
"""The KD terms ``LossConfig.kd`` and ``teachers[i].algorithm`` can name."""
PROJECTED = ("xtoken", "gold", "hkl")
"""The KD terms that read the teacher's projection ``W``."""
WHOLE_ROWS = ("uld", "gold", "hkl")
"""The KD terms that read whole rows of the student's distribution (``csd`` and ``xtoken`` ask
for (row, id) log probabilities only)."""


@dataclass
class TeacherLossConfig:
    """One teacher's part of the loss."""

    weight: float = 1.0
    """Multiplies this teacher's KD (``sum`` and ``select``; normalised to sum 1 in ``average``)."""
    k: int = 128
    """Top-K size of the teacher signal; 0 = dense (the whole distribution; another objective)."""
    student_to_teacher: str | None = None
    """S->T sub-token table (path or URI); with ``teacher_to_student``. Neither: the teacher
    shares the student's tokenizer (same-tokenizer top-K KD, no chunks)."""
    teacher_to_student: str | None = None
    """T->S sub-token table (path or URI)."""
    algorithm: str | None = None
    """This teacher's KD term: ``csd``, ``uld``, ``xtoken`` (X-Token's P-KL through
    ``projection``: :mod:`crosskd.loss.xtoken`), ``gold`` or ``hkl`` (X-Token's gold loss and
    H-KL: KL on the tokens ``projection`` pairs, sorted L1 on the rest; :mod:`crosskd.loss
    .gold`); None: ``loss.kd``. Teachers of one run may use different algorithms; their terms
    add up (``sum`` and ``select``)."""
    projection: str | None = None
    """The projection ``W`` student -> teacher (path or URI; ``crosskd projection build``),
    which ``xtoken``, ``gold`` and ``hkl`` read."""

    @property
    def same_tokenizer(self) -> bool:
        """No tables: the teacher is compared token by token with the student."""
        return self.student_to_teacher is None and self.teacher_to_student is None

    def check(self, key: str) -> None:
        """Refuse bad values, naming them under ``key`` (e.g. ``teachers[0]``)."""
        _finite(f"{key}.weight", self.weight, minimum=0.0)
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ConfigError(
                f"{key}.k is {self.k!r}; it must be an integer >= 0 (the top-K size of the "
                f"teacher signal; 0 = dense)."
            )
        if self.algorithm is not None and self.algorithm not in KD_METHODS:
            raise ConfigError(
                f"{key}.algorithm is {self.algorithm!r}; choose one of {', '.join(KD_METHODS)} "
                f"(or leave it out: loss.kd)."
            )
        if (self.student_to_teacher is None) != (self.teacher_to_student is None):
            given, missing = "student_to_teacher", "teacher_to_student"
            if self.student_to_teacher is None:
                given, missing = missing, given
            raise ConfigError(
                f"{key}.{given} is set but {key}.{missing} is not; a cross-tokenizer teacher "
                f"needs both table directions (`crosskd tables build`), a same-tokenizer "
                f"teacher neither."
            )


@dataclass
class LossConfig:
    """The student's loss: ``ce_weight * CE + kd_scale * KD``."""

    kd: str = "csd"
    """The KD term of every teacher that names no ``algorithm``: ``csd`` (Common-Support
    Distillation, chunk by chunk), ``uld`` (Universal Logit Distillation, the baseline: sorted
    probability vectors of index-paired positions compared by L1; :mod:`crosskd.loss.uld`) or
    ``xtoken`` (X-Token's projected KL through the teacher's ``projection``;
    :mod:`crosskd.loss.xtoken`), ``gold`` or ``hkl`` (X-Token's gold loss and H-KL;
    :mod:`crosskd.loss.gold`). ``divergence`` and ``beta`` apply to all but ``uld``, the chunk
    options (``keep_realized`` .. ``drop_unrealized_topk``) to ``csd`` only."""
    divergence: str = "jsd"
    """``jsd`` (generalised JSD with ``beta``), ``forward_kl`` KL(T||S) or ``reverse_kl``
    KL(S||T)."""
    beta: float = 0.5
    """JSD mixture weight of the teacher, in (0, 1)."""
    tau: float = 1.0
    """Temperature of both distributions; the teacher signal must have been made at it.
    KD is multiplied by tau^2."""
    ce_weight: float = 1.0
    """Weight of the student's next-token cross entropy."""
    kd_weight: float = 1.0
    """Static ``kd_scale``, or the factor in front of the dynamic one."""
    dynamic_kd_scale: bool = False
    """``kd_scale = kd_weight * min(|CE| / |KD|, max_kd_scale)`` per micro-batch, detached
    (0 when ``|KD| < 1e-8``)."""
    max_kd_scale: float = 1000.0
    """Cap of the dynamic ratio."""
    keep_realized: bool = False
    """Keep the realized event even when the teacher's top K misses it (changes the objective,
    even with K = V)."""
    min_mismatch_support: int = 2
    """Events a ``1:n`` / ``n:1`` chunk needs to count (1 with ``keep_realized``)."""
    mismatch_weight: float = 1.0
    """Weight of ``1:n``, ``n:1`` and ``n:m`` chunks (1:1 and special pairs weigh 1). The spec
    (``csd-spec.md`` section 5, "Normalisation") has 5; 1 distilled better in both pretrained
    settings of ``benchmarks/quality.py``, by 0.8% in domain and 1.0% out of domain on every
    seed (``docs/benchmarks.md``)."""
    realized_only_mismatch: bool = False
    """Compare ``1:n`` / ``n:1`` chunks on the realized event only, like ``n:m``."""
    drop_unrealized_topk: bool = False
    """Drop cross-tokenizer chunks whose last realized teacher token is outside the top K."""
    teacher_mode: str = "sum"
    """``sum`` (every teacher, weighted), ``select`` (per sample the teacher with the lowest
    bits per byte) or ``average`` (one KD against the weighted mixture; dense signals of
    teachers sharing one tokenizer only)."""
    teachers: list[TeacherLossConfig] = field(default_factory=lambda: [TeacherLossConfig()])
    """One entry per teacher, in teacher order (``teacher0``, ``teacher1``, ...)."""
    kernels: str = "eager"
    """How the per-block elementwise work over the student's logits runs (the log-normalisers
    and the logits' gradient; :mod:`crosskd.loss.kernels`): ``eager`` (torch operations, each a
    pass over the block) or ``compiled`` (``torch.compile``: one pass over each block; compiled
    on the first step, tens of seconds on a CPU; needs a C/C++ compiler where the loss runs,
    and on a GPU Triton and the Python headers: the CUDA image has them, the CPU image has no
    compiler). The values agree to float rounding."""

    def __post_init__(self) -> None:
        self.teachers = [_teacher(t, f"teachers[{i}]") for i, t in enumerate(self.teachers)]
        self.check()

    def check(self) -> None:
        """Refuse any bad value with a message naming its key."""
        if self.kd not in KD_METHODS:
            raise ConfigError(f"kd is {self.kd!r}; choose one of {', '.join(KD_METHODS)}.")
        if self.kernels not in KERNELS:
            raise ConfigError(f"kernels is {self.kernels!r}; choose one of {', '.join(KERNELS)}.")
        if self.divergence not in DIVERGENCES:
            raise ConfigError(
                f"divergence is {self.divergence!r}; choose one of {', '.join(DIVERGENCES)}."
            )
        _finite("beta", self.beta)
        if not 0 < self.beta < 1:
            raise ConfigError(f"beta is {self.beta!r}; the JSD mixture weight must be in (0, 1).")
        _finite("tau", self.tau)
        if self.tau <= 0:
            raise ConfigError(f"tau is {self.tau!r}; the temperature must be > 0.")
        for key in ("ce_weight", "kd_weight", "mismatch_weight"):
            _finite(key, getattr(self, key), minimum=0.0)
        _finite("max_kd_scale", self.max_kd_scale)
        if self.max_kd_scale <= 0:
            raise ConfigError(f"max_kd_scale is {self.max_kd_scale!r}; it must be > 0.")
        for key in (
            "dynamic_kd_scale",
            "keep_realized",
            "realized_only_mismatch",
            "drop_unrealized_topk",
        ):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} is {getattr(self, key)!r}; write true or false.")
        support = self.min_mismatch_support
        if isinstance(support, bool) or not isinstance(support, int) or support < 1:
            raise ConfigError(f"min_mismatch_support is {support!r}; it must be an integer >= 1.")
        if self.teacher_mode not in TEACHER_MODES:
            raise ConfigError(
                f"teacher_mode is {self.teacher_mode!r}; choose one of {', '.join(TEACHER_MODES)}."
            )
        if not self.teachers:
            raise ConfigError("teachers is empty; give at least one teacher.")
        for i, teacher in enumerate(self.teachers):
            teacher.check(f"teachers[{i}]")
            self._check_algorithm(i, teacher)
        if self.teacher_mode == "average":
            self._check_average()

    def algorithm(self, index: int) -> str:
        """The KD term of ``teachers[index]``: its ``algorithm``, else ``kd``."""
        return self.teachers[index].algorithm or self.kd

    def whole_rows(self) -> str | None:
        """Which teachers need whole rows of the student's logits (:data:`WHOLE_ROWS`: not the
        fused output layer), as ``teachers[0] (uld)``; None when no teacher does."""
        named = [
            f"teachers[{i}] ({self.algorithm(i)})"
            for i in range(len(self.teachers))
            if self.algorithm(i) in WHOLE_ROWS
        ]
        return ", ".join(named) or None

    def _check_algorithm(self, index: int, teacher: TeacherLossConfig) -> None:
        key = f"teachers[{index}]"
        algorithm = self.algorithm(index)
        if algorithm in PROJECTED:
            if teacher.projection is None:
                raise ConfigError(
                    f"{key} uses algorithm {algorithm}, which reads a projection, but "
                    f"{key}.projection is not set; build one with `crosskd projection build` "
                    f"and set {key}.projection to it."
                )
            if teacher.same_tokenizer:
                raise ConfigError(
                    f"{key} uses algorithm {algorithm} but has no tables, so it is a "
                    f"same-tokenizer teacher (compared token by token); {algorithm} is for a "
                    f"teacher with another tokenizer: set {key}.student_to_teacher and "
                    f"teacher_to_student."
                )
            if teacher.k == 0:
                raise ConfigError(
                    f"{key} uses algorithm {algorithm} with k 0 (a dense signal); it compares "
                    f"the teacher's top K, so give {key}.k > 0."
                )
        elif teacher.projection is not None:
            raise ConfigError(
                f"{key}.projection is set but {key} uses algorithm {algorithm}, which does not "
                f"read it; set {key}.algorithm to one of {', '.join(PROJECTED)}, or remove "
                f"the projection."
            )

    def _check_average(self) -> None:
        if len(self.teachers) < 2:
            raise ConfigError(
                "teacher_mode is 'average' with one teacher; average mixes several teachers "
                "(use 'sum' for one)."
            )
        algorithms = [self.algorithm(i) for i in range(len(self.teachers))]
        if len(set(algorithms)) > 1:
            raise ConfigError(
                f"teacher_mode is 'average' but the teachers use different algorithms "
                f"({', '.join(algorithms)}); average makes one KD term against the mixture, "
                f"so give every teacher the same algorithm, or use 'sum'."
            )
        for i, teacher in enumerate(self.teachers):
            if teacher.k != 0:
                raise ConfigError(
                    f"teacher_mode is 'average' but teachers[{i}].k is {teacher.k}; average "
                    f"mixes whole distributions, so every teacher needs a dense signal (k: 0). "
                    f"Use 'sum' or 'select' with top-K signals."
                )
        tables = {(t.student_to_teacher, t.teacher_to_student) for t in self.teachers}
        if len(tables) > 1:
            raise ConfigError(
                "teacher_mode is 'average' but the teachers have different tables "
                "(teachers[*].student_to_teacher / teacher_to_student); average needs teachers "
                "that share one tokenizer. Use 'sum' or 'select' across tokenizers."
            )
        if sum(t.weight for t in self.teachers) <= 0:
            raise ConfigError(
                "teacher_mode is 'average' but every teachers[*].weight is 0; give at least one "
                "teacher a positive weight."
            )

    def csd_options(self) -> CsdOptions:
        """The event options of the CSD term."""
        return CsdOptions(
            keep_realized=self.keep_realized,
            min_mismatch_support=self.min_mismatch_support,
            mismatch_weight=self.mismatch_weight,
            realized_only_mismatch=self.realized_only_mismatch,
            drop_unrealized_topk=self.drop_unrealized_topk,
        )


def check_teachers(
    config: LossConfig, student: LoadedTokenizer, teachers: list[LoadedTokenizer]
) -> None:
    """Check the config against the tokenizers it will run with.

    A teacher without tables must share the student's tokenizer (equal fingerprints; the error
    names the fields that differ). ``average`` needs every teacher on one tokenizer and one
    ``V``. (Tables are checked against the tokenizers when they are loaded:
    :meth:`crosskd.tables.TablePair.check_tokenizers`.)
    """
    if len(teachers) != len(config.teachers):
        raise ConfigError(
            f"teachers lists {len(config.teachers)} teacher(s) but {len(teachers)} teacher "
            f"tokenizer(s) were given; give one teachers[] entry per teacher, in order."
        )
    for i, (entry, tok) in enumerate(zip(config.teachers, teachers, strict=True)):
        if entry.same_tokenizer and tok.fingerprint != student.fingerprint:
            differ = differing_fields(student, tok)
            raise ConfigError(
                f"teachers[{i}] has no tables (student_to_teacher / teacher_to_student), so it "
                f"is a same-tokenizer teacher, but its tokenizer {tok.name} differs from the "
                f"student's {student.name} in: {', '.join(differ)}. Build the tables "
                f"(`crosskd tables build`) and set both keys to use it as a cross-tokenizer "
                f"teacher."
            )
    if config.teacher_mode == "average":
        first = teachers[0]
        for i, tok in enumerate(teachers[1:], start=1):
            if tok.fingerprint != first.fingerprint or tok.vocab_size != first.vocab_size:
                differ = differing_fields(first, tok)
                if tok.vocab_size != first.vocab_size:
                    differ.append(f"vocab_size ({first.vocab_size} vs {tok.vocab_size})")
                raise ConfigError(
                    f"teacher_mode is 'average' but teachers[{i}] ({tok.name}) does not share "
                    f"teachers[0]'s tokenizer ({first.name}); they differ in: "
                    f"{', '.join(differ)}. Use 'sum' or 'select' across tokenizers."
                )


def differing_fields(a: LoadedTokenizer, b: LoadedTokenizer) -> list[str]:
    """The fingerprint fields (model, normalizer, chat_template, ...) in which two tokenizers
    differ."""
    fa, fb = fingerprint_fields(a.hf, a.backend_json), fingerprint_fields(b.hf, b.backend_json)
    return [key for key in fa if fa[key] != fb.get(key)]


def _teacher(value: Any, key: str) -> TeacherLossConfig:
    if isinstance(value, TeacherLossConfig):
        return value
    if not isinstance(value, dict):
        raise ConfigError(
            f"{key} is {value!r}; write a mapping with keys "
            f"{', '.join(f.name for f in fields(TeacherLossConfig))}."
        )
    known = {f.name for f in fields(TeacherLossConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(
            f"{key}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}."
        )
    return TeacherLossConfig(**value)


def _finite(key: str, value: Any, minimum: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{key} is {value!r}; it must be a finite number.")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key} is {value!r}; it must be >= {minimum}.")
