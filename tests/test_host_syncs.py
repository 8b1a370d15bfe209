"""The training step reads the device back to the host a fixed number of times, whatever the
number of micro-batches: no synchronisation between a micro-batch's forward and backward pass
(the loss keeps its reported values on the device; the log-prob pass splits its pairs by block
on the host), none in the backward pass, one read of the step's reported values after the last
backward pass, one of the gradient norm.

There is no GPU here, so the reads are counted where they would synchronise one, in the
training thread only (:class:`HostReads`):

* outside a backward pass, a ``TorchFunctionMode`` follows which tensors live on the training
  device: the student's parameters, anything moved with ``.to`` / ``.cuda``, and everything
  computed from those (the loss plan's numpy arrays and the collated batch stay on the host
  until moved). It counts every call that copies such a tensor's values to the host:
  ``item``, ``tolist``, ``__bool__`` / ``__int__`` / ``__float__`` / ``__index__`` (a Python
  ``if``, ``int()``, a slice bound), ``cpu``, ``numpy``, ``nonzero`` / ``unique`` /
  ``masked_select``, and indexing with a boolean mask or with tensor slice bounds
  (data-dependent shapes); and every copy of host data to the device that does not say
  ``non_blocking`` (from pageable memory such a copy waits for every queued kernel);
* a backward pass (``Tensor.backward`` / ``torch.autograd.backward``), where every tensor is
  the device's (gradients, saved activations), runs under a ``TorchDispatchMode`` that counts
  the ATen operations that read values back (``_local_scalar_dense``, which every scalar
  conversion ends in, ``nonzero``, ``masked_select``, the ``unique`` family, ``bincount``,
  ``repeat_interleave`` without a size, ``equal``, indexing with a boolean mask), together with
  every ``tolist`` / ``numpy`` / ``cpu`` call. (A function mode cannot see this part: the
  autograd engine runs the backward functions inside the mode's own handler of ``backward``,
  where the mode is switched off.)

:func:`test_the_counter_sees_reads_in_both_passes_and_ignores_host_data` checks the counter
itself, so that it cannot go blind unnoticed."""

from __future__ import annotations

import threading
import traceback
from contextlib import ExitStack
from unittest import mock

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from train_inputs import train_config

from crosskd.loss import LossConfig, TeacherLossConfig
from crosskd.loss.logprobs import Requests, row_pieces
from crosskd.output_layer import OutputLayer
from crosskd.train import Trainer

Tensor = torch.Tensor
aten = torch.ops.aten
READS = {
    Tensor.item,
    Tensor.tolist,
    Tensor.__bool__,
    Tensor.__int__,
    Tensor.__float__,
    Tensor.__index__,
    Tensor.cpu,
    Tensor.numpy,
    Tensor.nonzero,
    torch.nonzero,
    Tensor.unique,
    torch.unique,
    Tensor.masked_select,
    torch.masked_select,
}
INDEXING = {Tensor.__getitem__, Tensor.__setitem__, Tensor.index_put, Tensor.index_put_}
BACKWARD = {Tensor.backward, torch.autograd.backward}
ATEN_READS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.bincount,
    aten.repeat_interleave,
    aten.equal,
}
ATEN_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
PYTHON_READS = ("tolist", "numpy", "cpu")


def _where(name: str) -> str:
    """``name`` and the innermost line that called it outside torch and this module."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and frame.filename != __file__:
            return f"{name} at {frame.filename}:{frame.lineno}"
    return name


class _BackwardReads(TorchDispatchMode):
    """Counts, in ``thread``, the ATen reads of a backward pass into ``reads``."""

    def __init__(self, thread: int, reads: list[str]) -> None:
        super().__init__()
        self.thread, self.reads = thread, reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if threading.get_ident() == self.thread:
            packet = func.overloadpacket
            boolean = packet in ATEN_INDEXING and any(
                isinstance(index, Tensor) and index.dtype in (torch.bool, torch.uint8)
                for index in args[1]
            )
            if packet in ATEN_READS or boolean:
                self.reads.append(_where(f"aten.{packet.__name__}"))
        return func(*args, **(kwargs or {}))


class HostReads(TorchFunctionMode):
    """Counts, in the thread that enters it, the host reads of device tensors (module
    docstring) into ``reads``; ``device``: tensors already on the device."""

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
                if (
                    isinstance(part, Tensor)
                    and part.dtype == torch.bool
                    and (self._device(part) or self._device(args[0]))
                ):
                    return True
                if isinstance(part, slice) and any(
                    self._device(b) for b in (part.start, part.stop, part.step)
                ):
                    return True
        return False

    def _blocking_copy(self, func, args: tuple, kwargs: dict) -> bool:
        """Host data copied to the device without ``non_blocking``: from pageable memory on
        CUDA such a copy makes the host wait for every kernel queued before it."""
        if func in (Tensor.to, Tensor.cuda) and not self._device(args[0]):
            moves = (
                func is Tensor.cuda
                or "device" in kwargs
                or any(isinstance(a, torch.device | str) for a in args[1:])
            )
            return moves and not kwargs.get("non_blocking", False)
        return False

    def _backward(self, func, args: tuple, kwargs: dict):
        """``func`` (a backward pass) with every read in it counted."""
        with ExitStack() as stack:
            for name in PYTHON_READS:
                stack.enter_context(mock.patch.object(Tensor, name, self._counted(name)))
            stack.enter_context(_BackwardReads(self.thread, self.reads))
            return func(*args, **kwargs)

    def _counted(self, name: str):
        original = getattr(Tensor, name)

        def read(tensor: Tensor, *args, **kwargs):
            if threading.get_ident() == self.thread:
                self.reads.append(_where(name))
            return original(tensor, *args, **kwargs)

        return read

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mine = threading.get_ident() == self.thread
        if mine and func in BACKWARD:
            return self._backward(func, args, kwargs)
        if mine and self._reads(func, args):
            self.reads.append(_where(getattr(func, "__name__", str(func))))
        if mine and self._blocking_copy(func, args, kwargs):
            self.reads.append(_where("blocking copy to the device"))
        out = func(*args, **kwargs)
        inputs, _ = tree_flatten((args, kwargs))
        if mine and (func in (Tensor.to, Tensor.cuda) or any(map(self._device, inputs))):
            for value in tree_flatten(out)[0]:
                if isinstance(value, Tensor):
                    self.on_device[id(value)] = value
        return out


class _ReadsInBackward(torch.autograd.Function):
    """Doubles its input; its backward pass reads a scalar, slices with a tensor bound and
    lists the gradient (three reads)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        stop = grad.argmax()
        grad[:stop].tolist()
        return grad * 2 if float(grad.sum()) else grad


def test_the_counter_sees_reads_in_both_passes_and_ignores_host_data():
    weights = torch.randn(6, requires_grad=True)
    with HostReads([weights]) as counter:
        host = torch.from_numpy(np.arange(6.0))
        assert host.tolist()[1] == 1.0 and int(host[2]) == 2 and host[host > 3].numel() == 2
        assert counter.reads == []
        host.to("cpu")
        assert [read.split(" at ")[0] for read in counter.reads] == ["blocking copy to the device"]
        counter.reads.clear()
        torch.from_numpy(np.arange(3.0)).to("cpu", non_blocking=True)
        assert counter.reads == []
        values = weights * host
        float(values.detach().sum())
        values[values > 0].sum()
        assert len(counter.reads) == 2, counter.reads
        _ReadsInBackward.apply(values).sum().backward()
    names = [read.split(" ")[0] for read in counter.reads[2:]]
    assert names.count("tolist") == 1 and names.count("aten._local_scalar_dense") == 2, names


def _reads_of_one_step(inputs: dict, output, micro_batch_rows: int) -> list[str]:
    loss = LossConfig(
        kd_weight=0.7,
        dynamic_kd_scale=True,
        teachers=[
            TeacherLossConfig(
                k=16, student_to_teacher=inputs["s2t"], teacher_to_student=inputs["t2s"]
            )
        ],
    )
    config = train_config(
        inputs,
        output,
        loss=loss,
        micro_batch_rows=micro_batch_rows,
        global_batch_rows=3,
        prefetch_steps=0,
    )
    trainer = Trainer(config, progress=False)
    trainer.setup()
    planned = trainer.step_inputs(0)
    assert len(planned) == 3 // micro_batch_rows
    with HostReads([*trainer.model.parameters(), *trainer.model.buffers()]) as counter:
        trainer.train_step(0, planned)
    trainer.close()
    return counter.reads


def test_a_training_step_reads_the_device_twice_whatever_its_micro_batches(train_inputs, tmp_path):
    """One micro-batch of 3 rows and three of one row: the same two reads (the reported
    values, then the gradient norm), none between a forward and its backward pass and none in
    a backward pass, and no blocking copy of host data to the device. (Before, each
    micro-batch read its CE, KD and terms with ``item``, its reported vector with ``tolist``,
    its metric values with ``cpu`` / ``numpy``, and the log-prob pass its owned pairs by
    boolean masks (and their gradients in the backward pass) and each backward block its
    bounds: 22 reads per micro-batch, 23 with one, 67 with three; and the loss's index arrays
    went to the device with plain ``.to``: 5 blocking copies per micro-batch here.)
    """
    one = _reads_of_one_step(train_inputs, tmp_path / "one", 3)
    three = _reads_of_one_step(train_inputs, tmp_path / "three", 1)
    assert len(one) == len(three) == 2, (one, three)
    assert [r.split(" ")[0] for r in one] == ["tolist", "__float__"]


def test_the_log_prob_pass_reads_nothing_back():
    """Forward and backward over 5 blocks of 2 rows, with pairs a vocabulary slice does not
    own: no host read at all (the pairs are split by block on the host, from numpy)."""
    logits = torch.randn(10, 7, requires_grad=True)
    rows = np.array([0, 3, 3, 9, 4, 1, 8, 3])
    ids = np.array([2, 6, 0, 9, -1, 5, 1, 6])
    owned = np.array([True, True, True, False, False, True, True, True])
    weights = torch.arange(8.0)
    with HostReads([logits]) as counter:
        normalizer, picked = row_pieces(logits, Requests.of([(rows, ids, 2.0)]), owned, 2)
        (normalizer.sum() + (picked * weights).sum()).backward()
    assert counter.reads == []
    scaled = logits.detach() / 2.0
    assert torch.allclose(normalizer, torch.logsumexp(scaled, -1))
    assert picked[3] == 0 and picked[4] == 0 and torch.isclose(picked[1], scaled[3, 6])
    expected = torch.softmax(scaled, -1) / 2.0
    for k, (row, token) in enumerate(zip(rows, ids, strict=True)):
        if owned[k]:
            expected[row, token] += weights[k] / 2.0
    assert torch.allclose(logits.grad, expected, atol=1e-6)


def test_the_fused_log_prob_pass_at_two_temperatures_reads_nothing_back():
    """The same through the output layer (hidden states ``[40, 3]``, a ``[7, 3]`` head with a
    bias, blocks of 16 rows), CE at tau 1 and KD at tau 2 in one pass: no host read."""
    hidden = torch.randn(40, 3, requires_grad=True)
    weight = torch.randn(7, 3, requires_grad=True)
    bias = torch.randn(7, requires_grad=True)
    rows, ids = np.array([0, 39, 17, 17]), np.array([2, 6, 0, 0])
    pairs = Requests.of([(rows[:2], ids[:2], 1.0), (rows[2:], ids[2:], 2.0)])
    with HostReads([hidden, weight, bias]) as counter:
        normalizer, picked = row_pieces(OutputLayer(hidden, weight, bias), pairs, None, 16)
        (normalizer.sum() + picked.sum()).backward()
    assert counter.reads == []
    logits = torch.nn.functional.linear(hidden, weight, bias).detach()
    assert torch.allclose(normalizer[1], torch.logsumexp(logits / 2.0, -1), atol=1e-6)
    assert torch.isclose(picked[2], logits[17, 0] / 2.0)
