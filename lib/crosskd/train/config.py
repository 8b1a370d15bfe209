"""The training configuration (``crosskd train``; the ``train`` part of ``crosskd distill``).

Every value is checked when the config is built (from YAML and ``key=value`` overrides through
:func:`crosskd.config.load_config`, or in Python); a bad one is a :class:`ConfigError` that names
the key, the value and what is allowed.

The data order of a run is fixed by ``global_batch_rows`` (packed rows per optimizer step), the
prepared data's fingerprint, ``seed`` and ``window_shards``, never by how the batch is split over
processes: each data-parallel rank takes its slice of every step's rows
(:mod:`crosskd.train.order`), so a run can resume on another number of processes with the same
global batch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from crosskd.errors import ConfigError
from crosskd.loss import LossConfig
from crosskd.parallel.layout import ParallelLayout
from crosskd.zoo.models import check_shape

INIT = "init"
"""The ``student`` value of a random-init student (``student_tokenizer`` + ``student_shape``)."""
ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
SCORED_ONLINE = ("online:", "http://", "https://")
"""The ``teachers`` entries that score text as it comes (a teacher run here or a server)."""


@dataclass
class OnPolicyConfig:
    """On-policy distillation (GKD style): rows of each step that are the student's own
    answers to prompts, sampled in the training process with the current weights, scored by
    the teachers online and trained on with the loss on the answer only
    (:mod:`crosskd.train.rollout`)."""

    prompts: str
    """Chat or text data rows (any URI :func:`crosskd.data.records.read_records` reads): each
    record's messages before its first assistant message are a prompt the student answers; a
    text record's first ``text_share`` of characters are a prompt the student continues as
    text (:mod:`crosskd.data.rollout`)."""
    fraction: float = 0.25
    """The share of each step's rows on a rank that are rollouts, in (0, 1): the step's
    prepared rows stay as they are (so the data order and resuming are unchanged) and
    ``round(fraction * R / (1 - fraction))`` rollout rows are added to the ``R`` prepared rows
    of the step on each data-parallel rank (at least 1)."""
    max_new_tokens: int = 128
    """Longest answer sampled, in student tokens (less where the prompt leaves less of the
    student's capacity)."""
    temperature: float = 1.0
    """Sampling temperature (> 0; 1: the student's own distribution, as GKD samples)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens holding this much probability, in (0, 1]
    (1: no cut)."""
    text_share: float = 0.5
    """Text prompts: the share of each text's characters given to the student (cut back to a
    whitespace), in (0, 1); it writes on from there."""
    seed: int = 0
    """Seed of the sampling: step ``s`` on data-parallel rank ``r`` samples from a seed made
    of this, ``s`` and ``r`` (and takes its prompts from a permutation seeded by this), so a
    resumed run samples what an uninterrupted one does."""

    @classmethod
    def from_mapping(cls, values: Any) -> OnPolicyConfig:
        """The config of a training config's ``on_policy:`` mapping, refusing unknown keys and
        a missing ``prompts`` by name (``on_policy.KEY``)."""
        _mapping_of("on_policy", values, cls)
        if "prompts" not in values:
            raise ConfigError(
                "on_policy.prompts is not set; give the chat or text data of the prompts."
            )
        return cls(**values)

    def check(self) -> None:
        """Refuse bad values naming the key (``on_policy.KEY``)."""
        _str("on_policy.prompts", self.prompts)
        _int("on_policy.max_new_tokens", self.max_new_tokens, 1)
        _int("on_policy.seed", self.seed, 0)
        for key, low, high, closed in (
            ("fraction", 0.0, 1.0, False),
            ("text_share", 0.0, 1.0, False),
            ("temperature", 0.0, math.inf, False),
            ("top_p", 0.0, 1.0, True),
        ):
            value = getattr(self, key)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (low < value < high or (closed and value == high))
            ):
                span = f"({low}, {high}{']' if closed else ')'}"
                raise ConfigError(f"on_policy.{key} is {value!r}; it must be a number in {span}.")


@dataclass
class TrainConfig:
    """One student training run. Step counts are optimizer steps; rows are packed rows."""

    student: str
    """The student: a Hugging Face causal-LM folder (safetensors weights and its tokenizer), an
    fsspec URI of one, ``zoo:NAME``, a hub id in the local cache, or ``init`` (a random-init
    Llama of ``student_shape`` for ``student_tokenizer``)."""
    data: str
    """Prepared training data (``crosskd prepare`` output), any fsspec URI."""
    output: str
    """Run folder or URI, on storage every process sees (S3, a shared volume):
    ``checkpoints/``, ``metrics-rank0.jsonl``, the final model under ``final/`` and the best
    held-out one under ``best/``."""
    teachers: list[str] = field(default_factory=list)
    """Per teacher, in teacher order: a teacher cache URI (``crosskd score`` output),
    ``online:REF`` to compute the signal here from the teacher model ``REF``, or the
    ``http://`` / ``https://`` URL of a ``crosskd serve`` teacher server (its bearer token from
    the environment variable ``CROSSKD_TEACHER_TOKEN``)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The loss (a mapping of :class:`crosskd.loss.LossConfig` keys; each ``loss.teachers[i]``
    names the tables of teacher ``i``, none for a same-tokenizer teacher)."""
    student_tokenizer: str | None = None
    """Tokenizer of an ``init`` student (any tokenizer reference); unused otherwise."""
    student_shape: dict = field(default_factory=dict)
    """Llama shape of an ``init`` student (``hidden_size``, ``num_hidden_layers``, ...)."""
    steps: int = 100
    """Optimizer steps of the whole run."""
    global_batch_rows: int | None = None
    """Packed rows per optimizer step over all processes; with the data and ``seed`` it fixes
    the data order. None: ``micro_batch_rows * grad_accum * data-parallel ranks`` of the first
    start (a resumed run keeps the recorded value)."""
    micro_batch_rows: int = 4
    """Packed rows per micro-batch per data-parallel rank (one forward/backward)."""
    window_shards: int = 8
    """The data order reads the shards in windows of this many (a seeded permutation of the
    shards, then of the packed rows within each window), so each process reads a shard once
    per epoch while it keeps two windows of shards in memory."""
    prefetch_steps: int = 2
    """Steps whose inputs a background thread reads, collates and plans ahead of training
    (0: each step reads its own, inline)."""
    teacher_concurrency: int = 4
    """Teacher servers: requests in flight at once per server per process (a micro-batch's
    samples are cut into at least this many requests, so the replicas behind a Service score
    them at once)."""
    teacher_connect_timeout_s: float = 10.0
    """Teacher servers: seconds to open a connection before the attempt is retried."""
    teacher_read_timeout_s: float = 300.0
    """Teacher servers: seconds to wait for the next bytes of an answer (which may wait in the
    server's queue) before the attempt is retried."""
    teacher_retry_s: float = 600.0
    """Teacher servers: seconds a request is retried (connection errors, timeouts, 429, 503,
    other 5xx; exponential backoff with jitter, ``Retry-After`` honoured up to 30 s) before the
    step fails as retryable (``crosskd train --nproc-per-node`` exits 200; the restarted job
    resumes from its checkpoint)."""
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    """How the student is spread over the processes (a mapping of
    :class:`crosskd.parallel.layout.ParallelLayout` keys: ``dp_replicate``, ``dp_shard``, ``tp``,
    ``cp``; their product is the number of processes). Default: plain data parallelism (DDP)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (less memory, about a third more compute)."""
    fused_head: bool = True
    """Compute the loss from the student's last hidden states and its output head, a block of
    rows at a time (the ``rows x V`` logits never exist; the same values and gradients; the
    backward pass computes each block's logits again). Used where that is exact: a plain
    linear head whose logits the model returns unchanged and ``loss.kd: csd``; elsewhere
    (Gemma 2's soft-capped logits, ULD) the trainer takes the logits and logs why. false:
    always the logits."""
    trainable: list[str] = field(default_factory=list)
    """Train only the student's parameters whose name (as the model's ``named_parameters`` gives
    it before parallelisation: ``model.embed_tokens.weight``, ``model.layers.29.mlp.up_proj
    .weight``, ``lm_head.weight``) matches one of these regular expressions (``re.search``);
    the rest stay frozen: no gradient, no optimizer state. Empty: every parameter. For
    tokenizer transfer, ``[embed_tokens, lm_head]`` trains the embeddings alone (a tied head
    shares them). A pattern no parameter matches is an error."""
    first_trainable: list[str] = field(default_factory=list)
    """Parameters trained alone first: for ``first_steps`` steps only the trained parameters
    whose name matches one of these regular expressions (as ``trainable`` matches) learn; the
    others get no update (their gradients are dropped before the clipping, which so counts the
    first ones alone), then join with a warmup of their own over ``warmup_steps``
    (:mod:`crosskd.train.schedule`; the metric ``lr_rest`` is their learning rate). The
    optimizer then has two parameter groups: a run resumes only with the same
    ``first_trainable`` set or unset. For a student moved onto a new tokenizer,
    ``[embed_tokens, lm_head]`` fits the new embeddings to the pretrained body before the body
    moves. Empty: every trained parameter from the first step."""
    first_steps: int = 0
    """Steps of ``first_trainable`` alone (> 0 with ``first_trainable``, below ``steps``)."""
    kd_warmup_steps: int = 0
    """Steps over which the KD term fades in: step ``s`` (0-based) weighs it
    ``loss.kd_weight * min(1, (s + 1) / kd_warmup_steps)`` (a dynamic ``kd_scale`` is scaled
    by the same factor). 0: the full weight from the first step."""
    grad_accum: int | None = None
    """Micro-batches per optimizer step per rank. None: ``global_batch_rows / (micro_batch_rows
    * data-parallel ranks)`` (1 when ``global_batch_rows`` is unset too)."""
    lr: float = 3e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int = 10
    """Steps of linear warmup from ``lr / warmup_steps`` to ``lr``."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at ``lr * min_lr_ratio``."""
    clip_norm: float = 1.0
    """Gradient norm clipping (0: off)."""
    seed: int = 0
    """Seed of the data order and of the student's random init."""
    checkpoint_every: int = 100
    """Steps between checkpoints (0: only at the end). A checkpoint is also written at the
    last step."""
    keep_checkpoints: int = 3
    """How many complete checkpoints to keep (0: all); older ones are deleted only after a newer
    one is complete."""
    eval_data: str | None = None
    """Prepared held-out data (for the same student tokenizer): held-out bits per byte are
    logged and exported, and the best student is kept under ``best/``. None: no evaluation.
    Needs whole logits: ``parallel.tp`` and ``parallel.cp`` 1."""
    eval_every: int | None = None
    """Steps between held-out evaluations (0: only at the end). None: with every checkpoint."""
    attn_implementation: str | None = None
    """The student's attention (``eager``, ``sdpa``, ``flash_attention_2``,
    ``flash_attention_3``); None: what transformers picks. Packed rows get the mask each one
    needs, so a packed row computes what its samples alone would."""
    metrics_port: int | None = None
    """Serve Prometheus ``/metrics`` on this port plus the process's ``LOCAL_RANK`` (0: any free
    port); None: off."""
    metrics_host: str = "0.0.0.0"
    """The address the metrics endpoint binds to (all interfaces, for a PodMonitor)."""
    metrics_final_scrape_s: float = 30.0
    """At the end (success, stop or failure), seconds to keep serving ``/metrics`` for one
    more scrape, so Prometheus reads the final values before the pod ends; only where the
    endpoint has been scraped before (0: stop at once)."""
    max_restarts: int = 3
    """``crosskd train --nproc-per-node``: retryable failures in a row without a new checkpoint
    before the pod gives up with a permanent exit code (:mod:`crosskd.train.launch`)."""
    collective_timeout_s: int = 1800
    """Seconds a collective (an all-reduce, or the wait while rank 0 publishes a checkpoint or
    writes a model folder to object storage) may take before the process group gives up
    (torch's NCCL default is 600)."""
    on_policy: OnPolicyConfig | None = None
    """On-policy distillation (a mapping of :class:`OnPolicyConfig` keys: ``prompts``,
    ``fraction``, ``max_new_tokens``, ``temperature``, ``top_p``, ``seed``): a share of each
    step's rows are the student's own answers, scored online. Every teacher must be online
    (``online:REF`` or a server), ``parallel.tp`` and ``parallel.cp`` 1. None: off."""

    def __post_init__(self) -> None:
        if isinstance(self.loss, dict):
            self.loss = loss_from_mapping(self.loss)
        if isinstance(self.parallel, dict):
            self.parallel = ParallelLayout.from_mapping(self.parallel)
        if isinstance(self.on_policy, dict):
            self.on_policy = OnPolicyConfig.from_mapping(self.on_policy)
        self.check()

    def check(self) -> None:
        """Refuse bad values naming the key."""
        for key in ("student", "data", "output", "metrics_host"):
            _str(key, getattr(self, key))
        for key in ("student_tokenizer", "eval_data", "attn_implementation"):
            if getattr(self, key) is not None:
                _str(key, getattr(self, key))
        if not isinstance(self.teachers, list) or not all(
            isinstance(t, str) and t for t in self.teachers
        ):
            raise ConfigError(
                f"teachers is {self.teachers!r}; it must be a list of teacher cache URIs, "
                f"online:REF strings or teacher server URLs."
            )
        if not isinstance(self.loss, LossConfig):
            raise ConfigError(f"loss is {self.loss!r}; it must be a mapping of loss keys.")
        if not isinstance(self.parallel, ParallelLayout):
            raise ConfigError(
                f"parallel is {self.parallel!r}; it must be a mapping of "
                f"dp_replicate, dp_shard, tp, cp."
            )
        self.parallel.check()
        if not isinstance(self.activation_checkpointing, bool):
            raise ConfigError(
                f"activation_checkpointing is {self.activation_checkpointing!r}; "
                f"it must be true or false."
            )
        _patterns("trainable", self.trainable)
        _patterns("first_trainable", self.first_trainable)
        _int("first_steps", self.first_steps, 0)
        _int("kd_warmup_steps", self.kd_warmup_steps, 0)
        if bool(self.first_trainable) != (self.first_steps > 0):
            given = "first_trainable" if self.first_trainable else "first_steps"
            raise ConfigError(
                f"{given} is set but "
                f"{'first_steps is 0' if self.first_trainable else 'first_trainable is empty'}; "
                f"give both (the parameters to train first and for how many steps) or neither."
            )
        for key in ("steps", "micro_batch_rows", "window_shards"):
            _int(key, getattr(self, key), 1)
        if self.first_steps >= self.steps:
            raise ConfigError(
                f"first_steps is {self.first_steps}, not below steps ({self.steps}): the "
                f"parameters outside first_trainable would never train; lower first_steps."
            )
        _int("prefetch_steps", self.prefetch_steps, 0)
        _int("teacher_concurrency", self.teacher_concurrency, 1)
        for key in ("global_batch_rows", "grad_accum"):
            if getattr(self, key) is not None:
                _int(key, getattr(self, key), 1)
        for key in ("warmup_steps", "checkpoint_every", "keep_checkpoints", "seed", "max_restarts"):
            _int(key, getattr(self, key), 0)
        if self.seed >= 2**63:
            raise ConfigError(f"seed is {self.seed}; it must be < 2**63.")
        _int("collective_timeout_s", self.collective_timeout_s, 1)
        check_shape("student_shape", self.student_shape)
        if self.eval_every is not None:
            _int("eval_every", self.eval_every, 0)
        if self.metrics_port is not None:
            _int("metrics_port", self.metrics_port, 0)
            if self.metrics_port > 65535:
                raise ConfigError(f"metrics_port is {self.metrics_port}; it must be <= 65535.")
        timeouts = ("teacher_connect_timeout_s", "teacher_read_timeout_s", "teacher_retry_s")
        for key in (
            "lr",
            "weight_decay",
            "clip_norm",
            "min_lr_ratio",
            "metrics_final_scrape_s",
            *timeouts,
        ):
            value = getattr(self, key)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ConfigError(f"{key} is {value!r}; it must be a finite number >= 0.")
        for key in ("lr", *timeouts):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key} is {getattr(self, key)!r}; it must be > 0.")
        if self.min_lr_ratio > 1:
            raise ConfigError(f"min_lr_ratio is {self.min_lr_ratio!r}; it must be in [0, 1].")
        if self.attn_implementation is not None and self.attn_implementation not in ATTENTION:
            raise ConfigError(
                f"attn_implementation is {self.attn_implementation!r}; packed rows are exact "
                f"with {', '.join(ATTENTION)} (or leave it unset)."
            )
        if self.student == INIT and not self.student_tokenizer:
            raise ConfigError(
                "student is 'init' (a random-init student) but student_tokenizer is not set; "
                "give the tokenizer the new student uses."
            )
        if self.student != INIT and (self.student_tokenizer or self.student_shape):
            key = "student_tokenizer" if self.student_tokenizer else "student_shape"
            raise ConfigError(
                f"{key} is set but student is {self.student!r}, not 'init'; a pretrained student "
                f"brings its own tokenizer and shape. Remove {key}."
            )
        if self.loss.teacher_mode == "average":
            raise ConfigError(
                "loss.teacher_mode is 'average', which needs dense teacher signals; teacher "
                "caches hold top-K signals, so training uses 'sum' or 'select'."
            )
        if len(self.teachers) != len(self.loss.teachers):
            raise ConfigError(
                f"teachers lists {len(self.teachers)} source(s) but loss.teachers has "
                f"{len(self.loss.teachers)} entr(y/ies); give one of each per teacher."
            )
        if self.on_policy is not None:
            self._check_on_policy()

    def _check_on_policy(self) -> None:
        """Refuse on-policy settings the trainer cannot sample or score, naming the key."""
        if not isinstance(self.on_policy, OnPolicyConfig):
            raise ConfigError(f"on_policy is {self.on_policy!r}; it must be a mapping.")
        self.on_policy.check()
        for i, ref in enumerate(self.teachers):
            if not ref.startswith(SCORED_ONLINE):
                raise ConfigError(
                    f"teachers[{i}] is {ref!r}, a cache, but on_policy is set: a cache cannot "
                    f"score text the student writes during training; give online:REF or a "
                    f"teacher server URL."
                )
        for key in ("tp", "cp"):
            if getattr(self.parallel, key) > 1:
                raise ConfigError(
                    f"parallel.{key} is {getattr(self.parallel, key)} with on_policy: sampling "
                    f"runs the whole student on each rank (generate cannot run a vocabulary "
                    f"slice of the head or a window of positions); use parallel.{key}: 1."
                )

    def batch_layout(self, dp: int) -> tuple[int, int]:
        """``(global_batch_rows, grad_accum)`` on ``dp`` data-parallel ranks, refusing a global
        batch that ``micro_batch_rows * dp`` does not divide, or a ``grad_accum`` that
        disagrees with it, naming the keys."""
        per_micro = self.micro_batch_rows * dp
        if self.global_batch_rows is None:
            accum = self.grad_accum or 1
            return per_micro * accum, accum
        accum, left = divmod(self.global_batch_rows, per_micro)
        if left or accum == 0:
            raise ConfigError(
                f"global_batch_rows is {self.global_batch_rows}, which micro_batch_rows "
                f"({self.micro_batch_rows}) x {dp} data-parallel rank(s) = {per_micro} does not "
                f"divide; choose micro_batch_rows so that it does."
            )
        if self.grad_accum is not None and self.grad_accum != accum:
            raise ConfigError(
                f"grad_accum is {self.grad_accum} but global_batch_rows {self.global_batch_rows}"
                f" / (micro_batch_rows {self.micro_batch_rows} x {dp} rank(s)) = {accum}; set "
                f"one of them, not both."
            )
        return self.global_batch_rows, accum


def loss_from_mapping(values: dict[str, Any]) -> LossConfig:
    """A :class:`LossConfig` from a mapping, refusing unknown keys by name (as ``loss.KEY``)."""
    _mapping_of("loss", values, LossConfig)
    try:
        return LossConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"loss.{exc}") from exc
    except (TypeError, AttributeError) as exc:  # e.g. teachers: 5 (not a list of mappings)
        raise ConfigError(
            f"loss: {exc}; give loss keys as a mapping, loss.teachers as a list of mappings."
        ) from exc


def _mapping_of(key: str, values: Any, cls: type) -> None:
    """Refuse ``values`` for the nested config ``key`` unless it is a mapping of the fields of
    the dataclass ``cls``, naming the unknown keys (as ``key: ...``)."""
    if not isinstance(values, dict):
        raise ConfigError(f"{key} is {values!r}; it must be a mapping of {key} keys.")
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"{key}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}."
        )


def _int(key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} is {value!r}; it must be an integer >= {minimum}.")


def _str(key: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} is {value!r}; it must be a non-empty string.")


def _patterns(key: str, value: Any) -> None:
    """``value`` must be a list of regular expressions."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(
            f"{key} is {value!r}; give a list of regular expressions over parameter names "
            f"(for example [embed_tokens, lm_head]), or [] for every parameter."
        )
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(
                f"{key}: {pattern!r} is not a regular expression ({exc}); fix the pattern."
            ) from exc
