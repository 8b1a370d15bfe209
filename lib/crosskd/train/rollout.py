"""On-policy rows of a training step (GKD / GOLD style): the student's own answers to prompts,
sampled in the training process with the current weights, prepared for every model through
the aligner, scored by the teachers online and trained on with the loss on the answer only.

Per optimizer step, on each data-parallel rank (:meth:`Rollouts.step`, called by the trainer in
its main thread, after the step's prepared micro-batches were read ahead: sampling needs the
weights of the step, and scoring needs the samples):

1. The step's prompts: ``rows`` of them (``round(fraction * R / (1 - fraction))``, ``R`` the
   step's prepared rows on the rank), position ``p = (step * dp + rank) * rows + k`` of the
   prompts in seeded permutations (one per pass over the prompts): a pure function of the
   step, so a resumed run takes the prompts an uninterrupted one does.
2. Sampling: ``model.generate`` under ``torch.no_grad`` in eval mode (then back to train
   mode), under the trainer's autocast, ``micro_batch_rows`` prompts at a time, left-padded,
   every draw from a generator forked from the seed of (``on_policy.seed``, step, rank)
   (:func:`torch.random.fork_rng`, so the training's own random state is untouched).
3. Each answer decoded (:func:`crosskd.data.rollout.answer_text`: cut at the first end token,
   special tokens dropped, stripped; a text prompt's continuation by
   :func:`~crosskd.data.rollout.continuation_text`, not stripped); empty answers are dropped
   (counted); the rest are prepared as ``crosskd prepare`` stores a conversation or a text
   (:func:`crosskd.data.rollout.rollout_samples`: the student's loss mask and the KD chunks
   cover the answer and its end-of-turn token only, or a text's continuation only,
   re-tokenised for each teacher and aligned).
4. Each group's samples collated and planned like a prepared micro-batch (the trainer's
   ``plan_rows``: every teacher's signal from its online source), one extra micro-batch per
   group of prompts. A group whose answers were all empty still gives one micro-batch (a
   placeholder row with nothing in its loss), so every rank runs the same number of forward
   and backward passes (each is a collective under DDP).

The rollouts depend on the number of data-parallel ranks (each rank's prompts and seed), unlike
the prepared data order.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from crosskd.alignment import ChatOptions
from crosskd.data.collate import Batch, PreparedData
from crosskd.data.preparation import Preparation
from crosskd.data.records import Record, read_records
from crosskd.data.rollout import (
    answer_text,
    continuation_text,
    continued,
    prompt_ids,
    rollout_prompt,
    rollout_samples,
    stop_ids,
    text_prompt_fits,
)
from crosskd.data.shards import FLAG_KD
from crosskd.errors import ConfigError, DataError
from crosskd.loss import LossPlan
from crosskd.tokenization import LoadedTokenizer
from crosskd.train.config import OnPolicyConfig
from crosskd.train.teachers import prepared_tokenizer

log = logging.getLogger(__name__)

PLACEHOLDER = "."
"""The answer of a group's placeholder row (its loss mask and KD flags are cleared)."""

Planner = Callable[[list[list[dict]]], tuple[Batch, LossPlan]]
"""Collates and plans packed rows (each a list of prepared samples) as a micro-batch."""


@dataclass(frozen=True)
class Sampler:
    """How a step samples: the student ``model`` (the module, not a DDP wrapper), its
    ``device``, the autocast dtype (None: the parameters' own) and whether every rank must run
    each forward pass (``synced``: ``generate(synced_gpus=True)``)."""

    model: torch.nn.Module
    device: torch.device
    compute_dtype: torch.dtype | None
    synced: bool


def rollout_rows(fraction: float, prepared_rows: int) -> int:
    """Rollout rows added to a step's ``prepared_rows`` on one rank:
    ``round(fraction * R / (1 - fraction))``; refuses 0 (a fraction too small for the batch)
    naming the key."""
    rows = round(fraction * prepared_rows / (1 - fraction))
    if rows < 1:
        raise ConfigError(
            f"on_policy.fraction {fraction} adds no rollout row to the {prepared_rows} prepared "
            f"row(s) of a step on each rank; raise it (or the batch)."
        )
    return rows


def rollout_preparation(data: PreparedData, student: LoadedTokenizer) -> Preparation:
    """The preparation the prepared ``data`` was made with (its tokenizers, checked against
    their recorded fingerprints, its capacities and chat options), for the rollouts."""
    models = data.manifest["models"]
    recorded = data.manifest["config"]
    teachers = [prepared_tokenizer(data.uri, entry) for entry in models[1:]]
    return Preparation.of(
        student,
        teachers,
        [int(entry["capacity"]) for entry in models],
        ChatOptions(tuple(recorded["included_regions"]), recorded["drop_first_chunk"]),
        same=[bool(entry.get("same_tokenizer")) for entry in models[1:]],
    )


class Rollouts:
    """The on-policy rows of a run on one data-parallel rank (module docstring)."""

    def __init__(
        self,
        config: OnPolicyConfig,
        preparation: Preparation,
        *,
        rows: int,
        micro_batch_rows: int,
        dp_rank: int,
        dp: int,
    ) -> None:
        """Read and render the prompts of ``config.prompts``; ``rows`` rollout rows per step on
        this rank (:func:`rollout_rows`), sampled ``micro_batch_rows`` at a time. Prompts that
        leave the student no room for an answer are dropped (logged); none left is an
        error."""
        self.config, self.preparation = config, preparation
        self.rows, self.micro_batch_rows = rows, micro_batch_rows
        self.dp_rank, self.dp = dp_rank, dp
        self.student = preparation.models[0]
        self.capacity = preparation.capacities[0]
        self.stops = stop_ids(self.student)
        pad = self.student.hf.pad_token_id
        self.pad = min(self.stops) if pad is None else pad
        self.prompts: list[Record] = []
        self.ids: list[np.ndarray] = []
        long = short = 0
        for record in read_records(config.prompts):
            # normalised first, so that a text prompt's length is where its answer starts
            record = preparation.normalized(record)
            try:
                prompt = rollout_prompt(record, config.text_share)
            except DataError:
                if record.messages is not None:
                    raise
                short += 1
                continue
            ids = prompt_ids(prompt, preparation)
            if len(ids) >= self.capacity or (
                prompt.messages is None and not text_prompt_fits(prompt, preparation)
            ):
                long += 1
                continue
            self.prompts.append(prompt)
            self.ids.append(ids)
        if long or short:
            log.warning(
                "on_policy.prompts %s: %d prompt(s) that fill a model's capacity (no room for "
                "an answer) and %d text(s) too short to split into a prompt and an answer left "
                "out",
                config.prompts,
                long,
                short,
            )
        if not self.prompts:
            raise ConfigError(f"on_policy.prompts {config.prompts}: no prompt to sample from.")
        self._orders: dict[int, np.ndarray] = {}

    def step_prompts(self, step: int) -> list[int]:
        """The prompt indices of optimizer step ``step`` (0-based) on this rank."""
        first = (step * self.dp + self.dp_rank) * self.rows
        picked = []
        for position in range(first, first + self.rows):
            epoch, at = divmod(position, len(self.prompts))
            if epoch not in self._orders:
                self._orders = {epoch: _permutation(self.config.seed, epoch, len(self.prompts))}
            picked.append(int(self._orders[epoch][at]))
        return picked

    def step(
        self, step: int, sampler: Sampler, plan: Planner
    ) -> tuple[list[tuple[Batch, LossPlan]], dict[str, float]]:
        """The extra micro-batches of optimizer step ``step`` on this rank (module docstring)
        and their metrics: ``rollout_rows`` (rows trained on), ``rollout_empty`` (empty answers
        dropped), ``rollout_generated_tokens`` (tokens sampled, each answer's end token
        included), ``rollout_sample_s`` and ``rollout_score_s`` (seconds sampling, and
        preparing, scoring and planning)."""
        picked = self.step_prompts(step)
        groups = [
            picked[i : i + self.micro_batch_rows]
            for i in range(0, len(picked), self.micro_batch_rows)
        ]
        started = time.perf_counter()
        devices = [sampler.device] if sampler.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(_step_seed(self.config.seed, step, self.dp_rank))
            sampled = [self._sample(group, sampler) for group in groups]
        sampling = time.perf_counter() - started
        micro_batches = []
        kept = empty = generated = 0
        for group, answers in zip(groups, sampled, strict=True):
            kept_prompts = [
                (self.prompts[p], text) for p, (text, _) in zip(group, answers, strict=True) if text
            ]
            conversations = [continued(prompt, text) for prompt, text in kept_prompts]
            starts = [_answer_start(prompt) for prompt, _ in kept_prompts]
            generated += sum(n for _, n in answers)
            empty += len(group) - len(conversations)
            kept += len(conversations)
            samples = rollout_samples(conversations, self.preparation, starts)
            if not samples:
                samples = [_placeholder(self.prompts[group[0]], self.preparation)]
            micro_batches.append(plan([[s] for s in samples]))
        return micro_batches, {
            "rollout_rows": float(kept),
            "rollout_empty": float(empty),
            "rollout_generated_tokens": float(generated),
            "rollout_sample_s": sampling,
            "rollout_score_s": time.perf_counter() - started - sampling,
        }

    def _sample(self, group: list[int], sampler: Sampler) -> list[tuple[str, int]]:
        """Each prompt of ``group`` continued by the student: its answer text and the tokens
        sampled (to its end token, included)."""
        prompts = [self.ids[p] for p in group]
        width = max(len(ids) for ids in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):  # left-padded: answers start at ``width``
            ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        cfg, model = self.config, sampler.model
        was_training = model.training
        model.eval()
        try:
            with (
                torch.no_grad(),
                torch.autocast(
                    sampler.device.type,
                    dtype=sampler.compute_dtype,
                    enabled=sampler.compute_dtype is not None,
                ),
            ):
                out = model.generate(
                    input_ids=ids.to(sampler.device),
                    attention_mask=mask.to(sampler.device),
                    do_sample=True,
                    temperature=float(cfg.temperature),
                    top_p=float(cfg.top_p),
                    top_k=0,
                    max_new_tokens=min(cfg.max_new_tokens, self.capacity - width),
                    pad_token_id=self.pad,
                    eos_token_id=sorted(self.stops),
                    synced_gpus=sampler.synced,
                )
        finally:
            model.train(was_training)
        answers = []
        for p, row in zip(group, out[:, width:].tolist(), strict=True):
            if self.prompts[p].messages is None:
                text, _ = continuation_text(self.student.hf, self.ids[p], row, self.stops)
            else:
                text, _ = answer_text(self.student.hf, row, self.stops)
            answers.append((text, _sampled(row, self.stops)))
        return answers


def _sampled(row: list[int], stops: frozenset[int]) -> int:
    """The tokens a sampler produced in ``row`` (a generated row, padded after its end): to
    its first stop id, included, else all."""
    return next((i + 1 for i, t in enumerate(row) if t in stops), len(row))


def _answer_start(prompt: Record) -> int | None:
    """Where the answer starts in a text prompt's continuation (None: a conversation)."""
    return None if prompt.messages is not None else len(prompt.text)


def _placeholder(prompt: Record, preparation: Preparation) -> dict:
    """A prepared row of ``prompt`` with nothing in its loss: no CE target, no KD chunk."""
    rollout = continued(prompt, PLACEHOLDER)
    (sample,) = rollout_samples([rollout], preparation, [_answer_start(prompt)])
    sample["student_loss_mask"] = [False] * len(sample["student_loss_mask"])
    for k in range(len(preparation.models) - 1):
        column = f"teacher{k}_chunk_flags"
        sample[column] = [int(flag) & ~FLAG_KD for flag in sample[column]]
    return sample


def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of ``n`` prompts in pass ``epoch`` over them."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def _step_seed(seed: int, step: int, rank: int) -> int:
    """The sampling seed of optimizer step ``step`` on data-parallel rank ``rank`` (the first
    8 bytes of a sha256, halved into a non-negative int64)."""
    digest = hashlib.sha256(f"crosskd-on-policy:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
