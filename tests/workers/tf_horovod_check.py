"""One rank of the TensorFlow installation check (``tests/test_tf_install.py``).

Usage: ``python tests/workers/tf_horovod_check.py PREFIX`` under horovodrun or mpirun ->
``PREFIX.rank<R>.json``. Checks that the environment holds both frameworks in one process and
a Horovod built for both, and that Horovod's own TensorFlow wrappers average gradients:
- ``horovod.tensorflow.DistributedGradientTape``: the averaged gradient equals the mean of the
  ranks' local gradients (gathered separately);
- ``horovod.tensorflow.keras.DistributedOptimizer`` with ``model.fit``: one SGD step on
  rank-dependent data moves the weights by ``lr`` times that mean, identically on every rank.
Each rank records its numbers; the test compares them, so a rank that trained alone fails.
"""
import json
import os
import sys
from pathlib import Path

import torch  # noqa: F401  (both frameworks in one process, torch first as hybridsync does)
import tensorflow as tf
import horovod.torch as hvd_torch
import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np

LR = 0.1
IN, OUT, BATCH = 6, 3, 8


def rank_data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Data that differs between ranks, so an un-averaged step gives different weights."""
    rng = np.random.default_rng(100 + rank)
    return (rng.normal(size=(BATCH, IN)).astype(np.float32),
            rng.normal(size=(BATCH, OUT)).astype(np.float32))


def start_weights() -> list[np.ndarray]:
    """The same start on every rank (seeded), so the check does not rely on a broadcast."""
    rng = np.random.default_rng(7)
    return [rng.normal(size=(IN, OUT)).astype(np.float32), rng.normal(size=(OUT,)).astype(np.float32)]


def local_gradients(x: np.ndarray, y: np.ndarray, weights: list[np.ndarray]) -> list[np.ndarray]:
    """This rank's own mean-squared-error gradients, without Horovod."""
    w, b = (tf.Variable(v) for v in weights)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
    return [g.numpy() for g in tape.gradient(loss, [w, b])]


def mean_over_ranks(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The mean of each array over the ranks, from an allgather (not the code under test)."""
    return [hvd.allgather(tf.constant(a[None]), name=f"gather.{i}").numpy().mean(axis=0)
            for i, a in enumerate(arrays)]


def check_tape(x: np.ndarray, y: np.ndarray, weights: list[np.ndarray]) -> float:
    """Largest difference between DistributedGradientTape's gradient and the ranks' mean."""
    w, b = (tf.Variable(v) for v in weights)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
    tape = hvd.DistributedGradientTape(tape)
    averaged = [g.numpy() for g in tape.gradient(loss, [w, b])]
    expected = mean_over_ranks(local_gradients(x, y, weights))
    return max(float(np.abs(a - e).max()) for a, e in zip(averaged, expected))


def check_keras(x: np.ndarray, y: np.ndarray, weights: list[np.ndarray]) -> tuple[float, list[float]]:
    """One model.fit step with Horovod's Keras optimizer: (error vs. the averaged SGD step, weights)."""
    model = tf.keras.Sequential([tf.keras.Input(shape=(IN,)), tf.keras.layers.Dense(OUT)])
    model.set_weights(weights)
    opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate=LR))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    after = model.get_weights()
    expected = [v - LR * g for v, g in zip(weights, mean_over_ranks(local_gradients(x, y, weights)))]
    error = max(float(np.abs(a - e).max()) for a, e in zip(after, expected))
    return error, np.concatenate([a.ravel() for a in after]).tolist()


if __name__ == "__main__":
    hvd.init()
    x, y = rank_data(hvd.rank())
    weights = start_weights()
    keras_error, keras_weights = check_keras(x, y, weights)
    record = {
        "rank": hvd.rank(), "size": hvd.size(),
        "tensorflow": tf.__version__, "torch": torch.__version__,
        "keras": tf.keras.__name__ + " " + getattr(tf.keras, "__version__", "?"),
        "legacy_keras": os.environ.get("TF_USE_LEGACY_KERAS", ""),
        "built": {"torch_gloo": hvd_torch.gloo_built(), "torch_mpi": hvd_torch.mpi_built(),
                  "tf_gloo": hvd.gloo_built(), "tf_mpi": hvd.mpi_built()},
        "tape_error": check_tape(x, y, weights),
        "keras_error": keras_error,
        "keras_weights": keras_weights,
    }
    Path(f"{sys.argv[1]}.rank{hvd.rank()}.json").write_text(json.dumps(record))
