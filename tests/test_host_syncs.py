"""The training step reads the device back to the host a fixed number of times, whatever the
number of micro-batches: no synchronisation between a micro-batch's forward and backward pass
(the loss keeps its reported values on the device; the log-prob pass has no data-dependent
slicing), one read of the step's reported values after the last backward pass, one of the
gradient norm.

There is no GPU here, so the reads are counted where they would synchronise one: a
``TorchFunctionMode`` follows which tensors live on the training device (the student's
parameters, anything moved there with ``.to``, and everything computed from those) and counts,
in the training thread, every call that copies such a tensor's values to the host: ``item``,
``tolist``, ``__bool__`` / ``__int__`` / ``__float__`` / ``__index__`` (a Python ``if``,
``int()``, a slice bound), ``cpu``, ``numpy``, ``nonzero`` / ``unique`` / ``masked_select``,
and indexing with a boolean mask or with tensor slice bounds (data-dependent shapes)."""

from __future__ import annotations

import threading
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from train_inputs import train_config

from crosskd.loss import LossConfig, TeacherLossConfig
from crosskd.loss.logprobs import row_pieces
from crosskd.train import Trainer

Tensor = torch.Tensor
READS = {Tensor.item, Tensor.tolist, Tensor.__bool__, Tensor.__int__, Tensor.__float__,
         Tensor.__index__, Tensor.cpu, Tensor.numpy, Tensor.nonzero, torch.nonzero,
         Tensor.unique, torch.unique, Tensor.masked_select, torch.masked_select}  # fmt: skip
INDEXING = {Tensor.__getitem__, Tensor.__setitem__, Tensor.index_put, Tensor.index_put_}


class HostReads(TorchFunctionMode):
    """Counts, in the thread that enters it, the host reads of device tensors (module
    docstring); ``device``: tensors already on the device."""

    def __init__(self, device: list[Tensor]) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.on_device: dict[int, Tensor] = {id(t): t for t in device}
        self.reads: list[str] = []

    def _device(self, value: object) -> bool:
        return isinstance(value, Tensor) and id(value) in self.on_device

    def _reads(self, func, args: tuple) -> bool:
        if func in READS:
            return self._device(args[0])
        if func in INDEXING and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            for part in index:
                if isinstance(part, Tensor) and part.dtype == torch.bool and (
                        self._device(part) or self._device(args[0])):  # fmt: skip
                    return True
                if isinstance(part, slice) and any(
                        self._device(b) for b in (part.start, part.stop, part.step)):  # fmt: skip
                    return True
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mine = threading.get_ident() == self.thread
        if mine and self._reads(func, args):
            where = traceback.extract_stack(limit=4)[0]
            self.reads.append(f"{getattr(func, '__name__', func)} at {where.filename}:"
                              f"{where.lineno}")  # fmt: skip
        out = func(*args, **kwargs)
        inputs, _ = tree_flatten((args, kwargs))
        if mine and (func in (Tensor.to, Tensor.cuda) or any(map(self._device, inputs))):
            for value in tree_flatten(out)[0]:
                if isinstance(value, Tensor):
                    self.on_device[id(value)] = value
        return out


def _reads_of_one_step(inputs: dict, output, micro_batch_rows: int) -> list[str]:
    loss = LossConfig(kd_weight=0.7, dynamic_kd_scale=True, teachers=[TeacherLossConfig(
        k=16, student_to_teacher=inputs["s2t"], teacher_to_student=inputs["t2s"])])
    config = train_config(inputs, output, loss=loss, micro_batch_rows=micro_batch_rows,
                          global_batch_rows=3, prefetch_steps=0)  # fmt: skip
    trainer = Trainer(config, progress=False)
    trainer.setup()
    planned = trainer.step_inputs(0)
    assert len(planned) == 3 // micro_batch_rows
    with HostReads(list(trainer.model.parameters())) as counter:
        trainer.train_step(0, planned)
    trainer.close()
    return counter.reads


def test_a_training_step_reads_the_device_twice_whatever_its_micro_batches(train_inputs,
                                                                           tmp_path):  # fmt: skip
    """One micro-batch of 3 rows and three of one row: the same two reads (the reported
    values, then the gradient norm), none between a forward and its backward pass. (Before,
    each micro-batch read its CE, KD and terms with ``item``, its reported vector with
    ``tolist``, its metric values with ``cpu``/``numpy`` and each log-prob block its bounds:
    15 reads with one micro-batch, 43 with three.)"""
    one = _reads_of_one_step(train_inputs, tmp_path / "one", 3)
    three = _reads_of_one_step(train_inputs, tmp_path / "three", 1)
    assert len(one) == len(three) == 2, (one, three)
    assert [r.split(" ")[0] for r in one] == ["tolist", "__float__"]


def test_the_log_prob_pass_reads_nothing_back():
    """Forward and backward over 5 blocks of 2 rows, with pairs a vocabulary slice does not
    own: no host read at all (each block's gradients are added without slicing by row)."""
    logits = torch.randn(10, 7, requires_grad=True)
    rows = torch.tensor([0, 3, 3, 9, 4, 1])
    ids = torch.tensor([2, 6, 0, 9, -1, 5])
    owned = torch.tensor([True, True, True, False, False, True])
    with HostReads([logits, rows, ids, owned]) as counter:
        normalizer, picked = row_pieces(logits, rows, ids, owned, 2.0, 2)
        (normalizer.sum() + (picked * torch.arange(6.0)).sum()).backward()
    assert counter.reads == []
    scaled = logits.detach() / 2.0
    assert torch.allclose(normalizer, torch.logsumexp(scaled, -1))
    assert picked[3] == 0 and picked[4] == 0 and torch.isclose(picked[1], scaled[3, 6])
    expected = torch.softmax(scaled, -1) / 2.0
    for k, (row, token) in enumerate(zip(rows.tolist(), ids.tolist(), strict=True)):
        if owned[k]:
            expected[row, token] += k / 2.0
    assert torch.allclose(logits.grad, expected, atol=1e-6)
