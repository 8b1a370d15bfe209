"""Parallel layouts of the student in real gloo processes against one process: FSDP2
(``dp_shard``), the vocabulary-parallel head and embedding (``tp``), position windows (``cp``),
``dp_shard x tp`` on 4 ranks; checkpoints written under one layout resumed under others; the
bytes each rank holds; the final model gathered from the shards; bad layouts refused by key."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from train_inputs import train_config
from train_workers import (
    gather_failure_worker,
    run_ddp,
    run_ranks,
    sync_copies_worker,
    tiny_llama,
)

from crosskd.errors import ConfigError
from crosskd.loss import LossConfig, TeacherLossConfig
from crosskd.parallel.layout import ParallelLayout
from crosskd.parallel.mesh import ParallelMesh
from crosskd.parallel.parallelize import parallelize
from crosskd.train import TrainConfig, Trainer

KEYS = ("loss", "ce", "kd", "kd_scale", "grad_norm", "tokens")


def _config(setup, output, **kw) -> TrainConfig:
    return train_config(setup, output, checkpoint_every=2, **kw)


def _single(config: TrainConfig) -> tuple[list[dict], Trainer]:
    trainer = Trainer(config, progress=False)
    trainer.setup()
    history = trainer.train()
    trainer.save()
    trainer.close()
    return history, trainer


def _same_curve(got: list[dict], want: list[dict], rel: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for key in KEYS:
            assert g[key] == pytest.approx(w[key], rel=rel, abs=1e-7), key


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "final" / "model.safetensors"))


def _rank(out, name: str, rank: int) -> dict:
    return json.loads((out / f"{name}-rank{rank}.json").read_text())


def test_fsdp2_tp_and_cp_on_two_ranks_train_like_one_process(train_inputs, tmp_path):
    """Each layout on 2 gloo ranks (FSDP2 and cp also with activation checkpointing, cp also
    over eager attention): the
    curve of one process to 1e-5 (loss, its terms, the gradient norm) and the same final model
    (gathered from FSDP2 shards and vocabulary slices one tensor at a time); under FSDP2 each
    rank holds half the parameter, gradient and AdamW bytes, the two halves adding up to the
    one-process figure."""
    want, single = _single(_config(train_inputs, tmp_path / "one"))
    runs = [
        (
            "fsdp",
            _config(train_inputs, tmp_path / "fsdp", micro_batch_rows=1, parallel={"dp_shard": 2}),
        ),
        ("tp", _config(train_inputs, tmp_path / "tp", parallel={"tp": 2})),
        ("cp", _config(train_inputs, tmp_path / "cp", parallel={"cp": 2})),
        # Recomputed layers repeat their collectives (FSDP2 gathers, cp's key/value gathers).
        (
            "fsdp_recompute",
            _config(
                train_inputs,
                tmp_path / "fsdp_recompute",
                parallel={"dp_shard": 2},
                micro_batch_rows=1,
                activation_checkpointing=True,
            ),
        ),
        (
            "cp_recompute",
            _config(
                train_inputs,
                tmp_path / "cp_recompute",
                parallel={"cp": 2},
                activation_checkpointing=True,
            ),
        ),
        (
            "cp_eager",
            _config(
                train_inputs, tmp_path / "cp_eager", parallel={"cp": 2}, attn_implementation="eager"
            ),
        ),
    ]
    run_ddp([(name, config, None) for name, config in runs], tmp_path)
    reference = _weights(tmp_path / "one")
    for name, _ in runs:
        for rank in (0, 1):
            _same_curve(_rank(tmp_path, name, rank)["history"], want)
        got = _weights(tmp_path / name)
        assert sorted(got) == sorted(reference), name
        for key, value in reference.items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6, msg=key)
    whole = single.state_bytes
    halves = [_rank(tmp_path, "fsdp", r)["state_bytes"] for r in (0, 1)]
    for kind in ("parameters", "gradients", "optimizer"):
        assert max(h[kind] for h in halves) <= 0.55 * whole[kind], kind
    # The shards partition the tensors; only AdamW's step counts (a float32 scalar per
    # parameter) are held whole by every rank.
    steps = 4 * len(list(single.model.parameters()))
    assert [halves[0][k] + halves[1][k] for k in ("parameters", "gradients", "optimizer")] == [
        whole["parameters"],
        whole["gradients"],
        whole["optimizer"] + steps,
    ]
    # tp = 2: each rank holds half the (tied) embedding and head; the decoder layers whole.
    vocab_bytes = single.model.get_input_embeddings().weight.numel() * 4
    tp_bytes = _rank(tmp_path, "tp", 0)["state_bytes"]["parameters"]
    assert tp_bytes == whole["parameters"] - vocab_bytes // 2


def test_whole_row_teachers_over_split_logits_train_like_one_process(train_inputs, tmp_path):
    """A gold teacher and a ULD teacher (whole rows of the student's distribution) under
    tp = 2 and cp = 2: each rank holds its vocabulary slice or its window of the logits, and
    each curve is one process's."""
    from crosskd.projection import build_projection, save_projection
    from crosskd.tables import load_table_pair

    pair = load_table_pair(train_inputs["s2t"], train_inputs["t2s"])
    w = save_projection(build_projection(pair), str(tmp_path / "w"))
    base = _config(train_inputs, tmp_path / "unused").loss
    teacher = base.teachers[0]
    losses = {
        "gold": replace(base, teachers=[replace(teacher, algorithm="gold", projection=w.source)]),
        "uld": replace(base, teachers=[replace(teacher, algorithm="uld")]),
    }
    want = {}
    for algorithm, loss in losses.items():
        config = _config(train_inputs, tmp_path / algorithm, loss=loss, steps=2)
        want[algorithm], _ = _single(config)
        assert all(h["kd/teacher0"] > 0 for h in want[algorithm])
    runs = []
    for algorithm, loss in losses.items():
        for key in ("tp", "cp"):
            name = f"{algorithm}_{key}"
            config = _config(train_inputs, tmp_path / name, loss=loss, steps=2, parallel={key: 2})
            runs.append((name, config, None))
    run_ddp(runs, tmp_path)
    for name, _, _ in runs:
        for rank in (0, 1):
            _same_curve(_rank(tmp_path, name, rank)["history"], want[name.split("_")[0]])


def test_a_frozen_embedding_stays_frozen_in_its_vocabulary_slices(train_inputs, tmp_path):
    """``trainable: [layers]`` under tp = 2: the (tied) embedding and head are sliced over the
    ranks, and their slices stay frozen: the gathered final model has the start's embedding and
    new decoder layers."""
    config = _config(train_inputs, tmp_path / "tp", parallel={"tp": 2}, trainable=["layers"])
    run_ddp([("tp", replace(config, steps=2), None)], tmp_path)
    start = load_file(f"{train_inputs['student']}/model.safetensors")
    got = _weights(tmp_path / "tp")
    assert torch.equal(got["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
    layers = [k for k in got if "layers" in k]
    assert layers and all(not torch.equal(got[k], start[k]) for k in layers)


def test_fsdp2_gradient_accumulation_holds_only_gradient_shards(train_inputs, tmp_path):
    """Two micro-batches of one row per step on each of 2 FSDP2 ranks train like one process
    with one micro-batch of 4 rows (static kd_scale: the dynamic one is per micro-batch), and
    no rank ever holds more than its half of the gradients: every micro-batch reduce-scatters
    (accumulating whole gradients until the last one would hold the model's size on every
    rank)."""
    loss = LossConfig(
        kd_weight=0.7,
        teachers=[
            TeacherLossConfig(
                k=16, student_to_teacher=train_inputs["s2t"], teacher_to_student=train_inputs["t2s"]
            )
        ],
    )
    common = {"loss": loss, "global_batch_rows": 4, "steps": 3}
    want, single = _single(_config(train_inputs, tmp_path / "one", micro_batch_rows=4, **common))
    accumulated = _config(
        train_inputs, tmp_path / "fsdp", micro_batch_rows=1, parallel={"dp_shard": 2}, **common
    )
    run_ddp([("fsdp", accumulated, None)], tmp_path)
    whole = single.state_bytes["gradients"]
    assert single.student.gradient_peak == whole
    for rank in (0, 1):
        got = _rank(tmp_path, "fsdp", rank)
        assert [len(m) for m in got["micro_batches"][0]] == [1, 1]
        _same_curve(got["history"], want)
        assert 0 < got["gradient_peak"] <= 0.55 * whole
    reference = _weights(tmp_path / "one")
    for key, value in _weights(tmp_path / "fsdp").items():
        torch.testing.assert_close(value, reference[key], rtol=1e-4, atol=1e-5, msg=key)


def test_dp_shard_x_tp_on_four_ranks_resumes_on_other_layouts(train_inputs, tmp_path):
    """``dp_shard=2 x tp=2``, HSDP (``dp_replicate=2 x dp_shard=2``), ``cp=2 x tp=2`` and
    ``dp_shard=2 x cp=2`` on 4 ranks train like one process; the first's step-2 checkpoint
    (each rank's own parts) resumes under ``dp_shard=4`` and in one process with an identical
    continuation, and loads in one process to the parameters and AdamW state of the
    one-process run's own step-2 checkpoint."""
    # One micro-batch of 4 rows per step on every layout (kd_scale is the last micro-batch's).
    global_batch = {"global_batch_rows": 4}
    want, _ = _single(_config(train_inputs, tmp_path / "one", micro_batch_rows=4, **global_batch))
    grid = _config(
        train_inputs,
        tmp_path / "grid",
        micro_batch_rows=2,
        parallel={"dp_shard": 2, "tp": 2},
        **global_batch,
    )
    reshard = _config(
        train_inputs,
        tmp_path / "grid",
        micro_batch_rows=1,
        parallel={"dp_shard": 4},
        **global_batch,
    )
    hsdp = _config(
        train_inputs,
        tmp_path / "hsdp",
        micro_batch_rows=1,
        parallel={"dp_replicate": 2, "dp_shard": 2},
        **global_batch,
    )
    cp_tp = _config(
        train_inputs,
        tmp_path / "cp_tp",
        micro_batch_rows=4,
        parallel={"cp": 2, "tp": 2},
        **global_batch,
    )
    fsdp_cp = _config(
        train_inputs,
        tmp_path / "fsdp_cp",
        micro_batch_rows=2,
        parallel={"dp_shard": 2, "cp": 2},
        **global_batch,
    )
    run_ddp(
        [
            ("grid", grid, 2),
            ("reshard", reshard, None),
            ("hsdp", hsdp, 2),
            ("cp_tp", cp_tp, 2),
            ("fsdp_cp", fsdp_cp, 2),
        ],
        tmp_path,
        world=4,
    )
    for rank in range(4):
        _same_curve(_rank(tmp_path, "grid", rank)["history"], want[:2])
        _same_curve(_rank(tmp_path, "hsdp", rank)["history"], want[:2])
        _same_curve(_rank(tmp_path, "cp_tp", rank)["history"], want[:2])
        _same_curve(_rank(tmp_path, "fsdp_cp", rank)["history"], want[:2])
        resumed = _rank(tmp_path, "reshard", rank)
        assert resumed["start"] == 2
        _same_curve(resumed["history"], want[2:])
    written = json.loads((tmp_path / "grid/checkpoints/step-0000002/index.json").read_text())
    assert written["ranks"] == 4 and written["layout"]["tp"] == 2
    head = written["tensors"]["model.model.embed_tokens.weight"]
    assert sorted(p["offset"][0] for p in head["parts"]) == [0, 83, 165, 248]  # 330 = 2 x 165
    # The 4-rank checkpoint in one process: the one-process run's own step-2 state.
    alone = tmp_path / "alone" / "checkpoints"
    shutil.copytree(tmp_path / "grid/checkpoints/step-0000002", alone / "step-0000002")
    (alone / "latest.json").write_text(json.dumps({"step": 2, "path": "step-0000002"}))
    loaded = Trainer(
        _config(train_inputs, tmp_path / "alone", micro_batch_rows=4, **global_batch),
        progress=False,
    )
    loaded.setup()
    mine = Trainer(
        _config(train_inputs, tmp_path / "mine", micro_batch_rows=4, steps=2, **global_batch),
        progress=False,
    )
    mine.setup()
    mine.train()
    for (name, a), b in zip(loaded.model.named_parameters(), mine.model.parameters(), strict=True):
        # Float32 rounding of other reduction orders, through two AdamW steps of lr 3e-3.
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            x, y = loaded.optimizer.state[a][key], mine.optimizer.state[b][key]
            torch.testing.assert_close(
                x, y, rtol=1e-4, atol=1e-4 * float(y.abs().max()), msg=f"{name} {key}"
            )
    _same_curve(loaded.train(), want[2:])
    loaded.close()
    mine.close()


def test_copies_of_a_gradient_on_cp_and_tp_ranks_are_made_equal(tmp_path):
    """Gradients that differ on every rank (rank + 1) after sync_copies: each is summed over
    its cp ranks (their windows' shares), and each whole tensor then holds the first tp rank's
    value, a vocabulary slice its own; on plain tensors and on FSDP2 shards; nothing crosses
    the data-parallel ranks."""
    layouts = [{"cp": 2, "tp": 2}, {"dp_shard": 2, "tp": 2}]
    run_ranks(sync_copies_worker, (layouts, tmp_path), tmp_path, world=4, timeout=300)
    sliced = {"model.embed_tokens.weight"}  # tied: the head's weight is the same parameter
    for rank in range(4):
        seen = json.loads((tmp_path / f"sync-rank{rank}.json").read_text())
        # {cp: 2, tp: 2}: rank = 2 cp + tp; {dp_shard: 2, tp: 2}: rank = 2 dp_shard + tp.
        cp_tp, fsdp_tp = seen["0"], seen["1"]
        assert "needs the window's rows of the whole row's mask" in seen["0-unmasked"]
        assert len(cp_tp) == len(fsdp_tp) == 1 + 2 * 9 + 1  # embedding, 2 layers, final norm
        for name, values in cp_tp.items():  # (tp + 1) + (2 + tp + 1), tp 0 for whole ones
            assert values == [2 * (rank % 2) + 4 if name in sliced else 4], (rank, name)
        for name, values in fsdp_tp.items():
            assert values == [rank + 1 if name in sliced else rank - rank % 2 + 1], (rank, name)


def test_a_failed_write_of_the_gathered_model_leaves_no_rank_in_a_gather(tmp_path):
    """Rank 0's first file write fails with every tensor still to gather: it goes on gathering
    with the other rank and raises at the end; both reach the barrier after (no hang)."""
    run_ranks(gather_failure_worker, (tmp_path,), tmp_path, world=2, timeout=120)
    raised = [json.loads((tmp_path / f"gather-rank{r}.json").read_text())["raised"] for r in (0, 1)]
    assert raised[0] is not None and raised[1] is None
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize(
    ("parallel", "world", "message"),
    [
        ({"dp_shard": 0}, 1, r"parallel.dp_shard is 0; it must be an integer >= 1"),
        (
            {"tp": 3},
            2,
            r"parallel.dp_shard \* parallel.cp \* parallel.tp = 1 \* 1 \* 3 = 3 "
            r"does not divide the 2 processes",
        ),
        (
            {"dp_replicate": 2, "dp_shard": 2},
            2,
            r"parallel.dp_replicate \* parallel.dp_shard \* "
            r"parallel.cp \* parallel.tp = 2 \* 2 \* 1 \* 1 "
            r"= 4, but there are 2 processes",
        ),
        ({"pp": 2}, 1, r"parallel: unknown key\(s\) pp; known keys: dp_replicate, dp_shard"),
    ],
)
def test_bad_layouts_are_refused_by_key(parallel, world, message):
    with pytest.raises(ConfigError, match=message):
        config = TrainConfig(student="s", data="d", output="o", teachers=["c"], parallel=parallel)
        config.parallel.resolved(world)


def test_layouts_that_do_not_fit_the_student_or_loss_are_refused(train_inputs, tmp_path):
    """A vocabulary that tp does not divide, an embedding that is not a plain lookup under tp,
    rotary frequencies that depend on the positions under cp, held-out evaluation of
    vocabulary-split logits: each refused with the key to change (the last in 2 real ranks)."""
    from transformers import AutoModelForCausalLM

    layout = ParallelLayout(tp=4).resolved(4)
    assert layout.dp_replicate == 1 and layout.dp == 1 and layout.model_parallel == 4
    model = AutoModelForCausalLM.from_pretrained(train_inputs["student"])  # 330 entries
    with pytest.raises(
        ConfigError,
        match=r"vocabulary has 330 entries, which parallel.tp = 4 "
        r"does not divide",
    ):
        parallelize(model, ParallelMesh(layout, 0, torch.device("cpu"), None, None))

    class ScaledEmbedding(torch.nn.Embedding):  # as Gemma's: the lookup times sqrt(hidden)
        def forward(self, ids):
            return super().forward(ids) * self.embedding_dim**0.5

    scaled = ScaledEmbedding(330, model.config.hidden_size)
    model.set_input_embeddings(scaled)
    plain = r"needs a plain nn.Embedding and nn.Linear head; LlamaForCausalLM has "
    with pytest.raises(ConfigError, match=plain + "ScaledEmbedding and Linear"):
        parallelize(model, ParallelMesh(layout, 0, torch.device("cpu"), None, None))
    cp_only = ParallelLayout(cp=2).resolved(2)  # cp runs the model's own embedding and head
    student = parallelize(model, ParallelMesh(cp_only, 0, torch.device("cpu"), None, None))
    assert student.sliced == frozenset() and model.get_input_embeddings() is scaled
    dynamic = tiny_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(
        ConfigError,
        match=r"LlamaForCausalLM uses 'dynamic' rotary embeddings, "
        r".* train it with parallel.cp=1",
    ):
        parallelize(dynamic, ParallelMesh(cp_only, 0, torch.device("cpu"), None, None))
    flash = tiny_llama()
    flash.config._attn_implementation = "flash_attention_2"  # a micro-batch as one row
    with pytest.raises(
        ConfigError,
        match=r"it has 'flash_attention_2' .* Set "
        r"attn_implementation to sdpa or eager",
    ):
        parallelize(flash, ParallelMesh(cp_only, 0, torch.device("cpu"), None, None))
    layerless = tiny_llama()
    layerless._no_split_modules = []  # a model that names no decoder layer class
    layers = r"names no decoder layer class \(_no_split_modules\), so it cannot be split per "
    with pytest.raises(ConfigError, match=layers + r"layer .* parallel.cp=1"):
        parallelize(layerless, ParallelMesh(cp_only, 0, torch.device("cpu"), None, None))
    config = train_config(
        train_inputs, tmp_path / "eval", parallel={"tp": 2}, eval_data=train_inputs["heldout"]
    )
    with pytest.raises(
        AssertionError,
        match=r"held-out evaluation needs whole logits \(cp and "
        r"tp 1\)",
    ):
        run_ddp([("eval", config, None)], tmp_path, timeout=120)


def test_heldout_evaluation_under_fsdp2_equals_one_process(train_inputs, tmp_path):
    """Two FSDP2 ranks score 2 and 1 held-out samples (their forward passes in lockstep: the
    one with fewer batches joins the other's): the one-process bits per byte, and the same
    best/ step."""
    want, _ = _single(
        _config(train_inputs, tmp_path / "one", steps=4, eval_data=train_inputs["heldout"])
    )
    config = _config(
        train_inputs,
        tmp_path / "fsdp",
        steps=4,
        micro_batch_rows=1,
        parallel={"dp_shard": 2},
        eval_data=train_inputs["heldout"],
    )
    run_ddp([("fsdp", config, None)], tmp_path)
    got = _rank(tmp_path, "fsdp", 0)["history"]
    scored = [
        (g["heldout_bits_per_byte"], w["heldout_bits_per_byte"])
        for g, w in zip(got, want, strict=True)
        if "heldout_bits_per_byte" in w
    ]
    assert len(scored) == 2
    for g, w in scored:
        assert g == pytest.approx(w, rel=1e-5)
    best = [
        json.loads((tmp_path / run / "best/crosskd-model.json").read_text())["step"]
        for run in ("fsdp", "one")
    ]
    assert best[0] == best[1]


def test_activation_checkpointing_recomputes_the_same_step(train_inputs, tmp_path):
    """Each decoder layer recomputed in the backward pass: the same curve as keeping the
    activations (the same arithmetic, in another order of evaluation)."""
    want = Trainer(_config(train_inputs, tmp_path / "kept", steps=3), progress=False)
    want.setup()
    kept = want.train()
    want.close()
    again = Trainer(
        _config(train_inputs, tmp_path / "again", steps=3, activation_checkpointing=True),
        progress=False,
    )
    again.setup()
    checkpointed = [m for m in again.model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert checkpointed, "no layer is checkpointed"
    _same_curve(again.train(), kept)
    again.close()
    with pytest.raises(
        ConfigError,
        match=r"activation_checkpointing is 'yes'; it must be true "
        r"or false",
    ):
        _config(train_inputs, tmp_path / "bad", activation_checkpointing="yes")
