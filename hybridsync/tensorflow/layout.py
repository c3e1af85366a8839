"""How TensorFlow gradients cross into torch and back: flat tensor lists, conversions, backward groups.

A ``tf.numpy_function`` takes and returns flat lists of dense tensors; ``Layout`` says where each
gradient (dense, ``tf.IndexedSlices`` or ``None``) sits in such a list. ``backward_groups`` cuts a
step's gradients into the groups the bridge hands to the runtime while the backward pass still runs.

What each side copies, checked on TensorFlow 2.21 and torch 2.13 (not assumed):

- *In.* A ``numpy_function``'s input arrays are writable views of TensorFlow's buffers, which
  other ops of the graph may read too, and the router writes its results into a mirror's gradient
  in place. The mirror's gradient gets memory of its own anyway: ``torch.autograd.backward``'s
  ``AccumulateGrad`` clones a gradient that something else still references (the bridge's list
  does), so the bridge hands the views over without copying them first.
- *Out.* TensorFlow adopts a returned array's memory when it is aligned, as torch's allocations
  are: a view of a mirror's gradient *becomes* the graph's tensor. That is safe once the step
  synchronized (the gradient is then dropped, never written again: the next pass starts a new
  one); a pass that only accumulated returns copies, since the next pass adds into that memory.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf
import torch


def torch_gradient(mirror: torch.nn.Parameter, values: np.ndarray, indices: np.ndarray | None = None) -> torch.Tensor:
    """A gradient of ``mirror`` from TensorFlow's arrays, sharing their memory where the dtypes allow:
    dense from ``values``, or sparse from touched rows. Hand it to ``torch.autograd.backward`` while
    holding a reference, so that the mirror's gradient is a copy (see the module docstring)."""
    tensor = torch.from_numpy(values if values.flags.writeable else np.array(values)).to(mirror.dtype)
    if indices is None:
        return tensor.reshape(mirror.shape)
    rows = torch.from_numpy(np.asarray(indices, dtype=np.int64)).unsqueeze(0)
    return torch.sparse_coo_tensor(rows, tensor, mirror.shape, check_invariants=False)


def numpy_parts(gradient: torch.Tensor) -> list[np.ndarray]:
    """A synchronized torch gradient as NumPy views: ``[dense]``, or ``[values, row indices]`` with the
    gathered rows as they are, repeats included, as Horovod returns them (TensorFlow's optimizers
    sum repeated rows of an ``IndexedSlices``)."""
    if gradient.is_sparse:
        return [gradient._values().numpy(), gradient._indices()[0].numpy()]
    return [gradient.detach().numpy()]


def gradient_values(gradient: Any) -> tf.Tensor:
    """The tensor holding a gradient's numbers: itself if dense, its values if ``tf.IndexedSlices``."""
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def backward_groups(gradients: Sequence[Any], group_bytes: int) -> list[list[int]]:
    """Indices of the gradients that are not ``None``, in backward order (the variables' order
    reversed: a model's last layer gets its gradient first), cut into groups of at least
    ``group_bytes`` each (the last one may hold less)."""
    groups: list[list[int]] = [[]]
    held = 0
    for index in reversed(range(len(gradients))):
        gradient = gradients[index]
        if gradient is None:
            continue
        values = gradient_values(gradient)
        groups[-1].append(index)
        held += (values.shape.num_elements() or 0) * values.dtype.size  # unknown rows: counts as 0
        if held >= group_bytes:
            groups.append([])
            held = 0
    return [group for group in groups if group]


class Layout:
    """How one step's gradients (dense, ``tf.IndexedSlices`` or ``None``, per variable) travel through
    ``tf.numpy_function`` as a flat list of tensors: a dense gradient as itself, an ``IndexedSlices``
    as its values and its (int64) indices, ``None`` not at all. Built when the step is traced."""

    def __init__(self, gradients: Sequence[Any]) -> None:
        self.kinds: list[tuple[str, Any]] = []
        """Per gradient: ``("none" | "dense" | "sparse", the IndexedSlices' dense shape or None)``."""
        self.dense_flags: list[bool] = []
        """Per flat tensor: a dense gradient (else a sparse one's values or indices)."""
        for gradient in gradients:
            if gradient is None:
                self.kinds.append(("none", None))
            elif isinstance(gradient, tf.IndexedSlices):
                self.kinds.append(("sparse", gradient.dense_shape))
                self.dense_flags += [False, False]
            else:
                self.kinds.append(("dense", None))
                self.dense_flags.append(True)

    @property
    def present(self) -> list[bool]:
        """Per gradient: not ``None``."""
        return [kind != "none" for kind, _ in self.kinds]

    def flatten(self, gradients: Sequence[Any]) -> list[tf.Tensor]:
        flat: list[tf.Tensor] = []
        for gradient, (kind, _) in zip(gradients, self.kinds):
            if kind == "sparse":
                flat += [gradient.values, tf.cast(gradient.indices, tf.int64)]
            elif kind == "dense":
                flat.append(tf.convert_to_tensor(gradient))
        return flat

    def rebuild(self, flat: list[tf.Tensor]) -> list[Any]:
        """The gradients from a flat list shaped as ``flatten`` makes it."""
        out: list[Any] = []
        position = 0
        for kind, dense_shape in self.kinds:
            if kind == "none":
                out.append(None)
            elif kind == "dense":
                out.append(flat[position])
                position += 1
            else:
                out.append(tf.IndexedSlices(flat[position], flat[position + 1], dense_shape))
                position += 2
        return out

    def to_torch(self, arrays: Sequence[np.ndarray],
                 mirrors: Sequence[torch.nn.Parameter]) -> list[torch.Tensor | None]:
        """Inside the ``numpy_function``: per variable its torch gradient (``torch_gradient``)."""
        out: list[torch.Tensor | None] = []
        position = 0
        for (kind, _), mirror in zip(self.kinds, mirrors):
            if kind == "none":
                out.append(None)
            elif kind == "dense":
                out.append(torch_gradient(mirror, arrays[position]))
                position += 1
            else:
                out.append(torch_gradient(mirror, arrays[position], arrays[position + 1]))
                position += 2
        return out

    def to_arrays(self, gradients: Sequence[torch.Tensor | None], dtypes: Sequence[np.dtype], *,
                  copy: bool) -> list[np.ndarray]:
        """Synchronized torch gradients as the flat NumPy list in ``dtypes`` (the flat inputs'):
        views where the dtype matches, unless ``copy`` (see the module docstring)."""
        parts = [part for (kind, _), gradient in zip(self.kinds, gradients) if kind != "none"
                 for part in numpy_parts(gradient)]
        convert = np.array if copy else np.asarray
        return [convert(part, dtype=dtype) for part, dtype in zip(parts, dtypes)]
