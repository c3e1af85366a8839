"""What crosses between TensorFlow and torch (``hybridsync.tensorflow.layout``): the groups the bridge
hands over during the backward pass, and the copies it relies on torch and TensorFlow to make or
to skip. The multi-rank results of the overlapped bridge are in ``tests/test_tensorflow.py``."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed here (scripts/bootstrap.sh installs it)")
import torch  # noqa: E402

from hybridsync.tensorflow.layout import Layout, backward_groups, torch_gradient  # noqa: E402

pytestmark = pytest.mark.unit


def _gradients() -> list:
    """Per variable of a 3-layer model (kernel, bias; 4-byte floats), one None and one sparse."""
    return [tf.zeros((100, 100)), tf.zeros(100), None, tf.zeros((100, 10)),
            tf.IndexedSlices(tf.zeros((3, 10)), tf.constant([0, 4, 4]), tf.constant([50, 10]))]


def test_groups_follow_the_backward_pass_and_close_at_the_threshold():
    gradients = _gradients()
    assert backward_groups(gradients, 1) == [[4], [3], [1], [0]]  # last variable first; None nowhere
    # 4 KB: the sparse rows (unknown count in a graph, 120 bytes here) and 4000 bytes close the first
    assert backward_groups(gradients, 4000) == [[4, 3], [1, 0]]
    assert backward_groups(gradients, 1 << 30) == [[4, 3, 1, 0]]
    assert backward_groups([None, None], 1) == []


def test_a_mirror_takes_a_copy_so_the_runtime_never_writes_into_tensorflows_arrays():
    """TensorFlow hands ``numpy_function`` writable views of buffers other ops may read: the mirror's
    gradient, which the router overwrites in place, must not be one of them."""
    def overwrite(parameter: torch.nn.Parameter) -> None:
        parameter.grad.mul_(-1)  # as the router writes results into the gradient

    mirror = torch.nn.Parameter(torch.zeros(4, 3))
    mirror.register_post_accumulate_grad_hook(overwrite)
    values = np.arange(12, dtype=np.float32)
    gradient = torch_gradient(mirror, values)
    torch.autograd.backward([mirror], [gradient])
    assert np.array_equal(values, np.arange(12, dtype=np.float32))
    assert torch.equal(mirror.grad, -torch.arange(12, dtype=torch.float32).reshape(4, 3))
    sparse = torch.nn.Parameter(torch.zeros(5, 2))
    rows = torch_gradient(sparse, np.ones((2, 2), np.float32), np.array([1, 3]))
    torch.autograd.backward([sparse], [rows])
    sparse.grad._values().mul_(3)
    assert np.array_equal(rows._values().numpy(), np.ones((2, 2)))


def test_synchronized_gradients_return_as_views_and_accumulating_ones_as_copies():
    gradients = _gradients()
    layout = Layout(gradients)
    flat = layout.flatten(gradients)
    dtypes = [t.dtype.as_numpy_dtype for t in flat]
    synced = [torch.ones(100, 100), torch.ones(100), None, torch.ones(100, 10),
              torch.sparse_coo_tensor(torch.tensor([[0, 4]]), torch.ones(2, 10), (50, 10), check_invariants=True)]
    views = layout.to_arrays(synced, dtypes, copy=False)
    copies = layout.to_arrays(synced, dtypes, copy=True)
    assert [a.dtype for a in views] == [np.float32] * 4 + [np.int64]
    assert np.shares_memory(views[0], synced[0].numpy()) and not np.shares_memory(copies[0], synced[0].numpy())
    assert [a.shape for a in copies] == [(100, 100), (100,), (100, 10), (2, 10), (2,)]


def test_tensorflow_adopts_an_aligned_array_a_numpy_function_returns():
    """Why an accumulating pass returns copies: a view returned to TensorFlow *is* the graph's tensor
    (TensorFlow takes an aligned array's memory), so writing into the mirror's gradient later would
    change it."""
    kept = {}

    def body(_):
        kept["grad"] = torch.ones(1 << 16)  # torch's allocations are aligned
        return kept["grad"].numpy()

    result = tf.function(lambda x: tf.numpy_function(body, [x], tf.float32, stateful=True))(tf.constant(0.0))
    kept["grad"].fill_(-1.0)
    assert float(result[0]) == -1.0
