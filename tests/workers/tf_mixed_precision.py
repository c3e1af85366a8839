"""Mixed precision under hybridsync's Keras optimizer, on every rank of a job; writes
``PREFIX.rank<r>.json``: per case, the final variables' checksum, the loss scale, or the error.

    python tf_mixed_precision.py PREFIX          # Keras 2 or 3, as TF_USE_LEGACY_KERAS says

Rank 0's second batch overflows float16 (its inputs are 1e6); rank 1's never does. A loss-scale
optimizer must skip that step on both ranks, or neither: one that skipped alone would leave the
other waiting in the synchronization (the job times out) or would pair mismatched steps.

Cases: ``compiled`` (``model.compile`` wraps the optimizer in a ``LossScaleOptimizer``: Keras 2
votes, Keras 3 refuses), ``wrapped_inside`` (``DistributedOptimizer(LossScaleOptimizer(opt))``),
``compiled_legacy`` (Keras 2's legacy SGD, compiled) and ``apply`` (float32; a Keras 3 loop
calling ``optimizer.apply`` itself).
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hybridsync.tensorflow as hst  # noqa: E402
from hybridsync.tensorflow import keras as hst_keras  # noqa: E402

STEPS, BATCH, FEATURES = 4, 16, 8


def make_model(policy: str) -> tf.keras.Model:
    tf.keras.mixed_precision.set_global_policy(policy)
    tf.keras.utils.set_random_seed(5)
    inputs = tf.keras.Input(shape=(FEATURES,))
    hidden = tf.keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    outputs = tf.keras.layers.Dense(1, name="out", dtype="float32")(hidden)
    return tf.keras.Model(inputs, outputs)


def batch(step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 * step + rank)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    if rank == 0 and step == 1:
        x *= 1e6  # beyond float16: this rank's gradients are inf/NaN this step, the other rank's finite
    return x, x[:, :1] * 0.5


def loss_scale(optimizer: tf.keras.optimizers.Optimizer) -> float:
    scale = getattr(optimizer, "dynamic_scale", None)  # Keras 3; Keras 2 calls it loss_scale
    return float(scale if scale is not None else optimizer.loss_scale)


def fit(optimizer: tf.keras.optimizers.Optimizer, rank: int) -> dict:
    model = make_model("mixed_float16")
    model.compile(optimizer=optimizer, loss="mse")
    hst.broadcast_variables(model.variables, root_rank=0)
    for step in range(STEPS):
        model.fit(*batch(step, rank), batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    weights = [v.numpy() for v in model.trainable_variables]
    return {"checksum": float(sum(np.abs(w).sum() for w in weights)),
            "finite": bool(all(np.isfinite(w).all() for w in weights)), "loss_scale": loss_scale(model.optimizer)}


def apply_directly(rank: int) -> dict:
    model = make_model("float32")
    optimizer = hst_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05))
    hst.broadcast_variables(model.variables, root_rank=0)
    for step in range(STEPS):
        x, y = batch(step + 10, rank)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return {"checksum": float(sum(np.abs(v.numpy()).sum() for v in model.trainable_variables))}


def case(run) -> dict:
    try:
        return run()
    except ValueError as e:
        return {"error": str(e)}


def main() -> None:
    hst.init()
    rank = hst.rank()
    keras3 = hasattr(tf.keras.optimizers.Optimizer, "apply")
    results = {
        "keras": 3 if keras3 else 2,
        "compiled": case(lambda: fit(hst_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05)), rank)),
        "wrapped_inside": case(lambda: fit(hst_keras.DistributedOptimizer(
            tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(0.05))), rank)),
    }
    if keras3:
        results["apply"] = case(lambda: apply_directly(rank))
    else:
        results["compiled_legacy"] = case(lambda: fit(hst_keras.DistributedOptimizer(
            tf.keras.optimizers.legacy.SGD(0.05)), rank))
    with open(f"{sys.argv[1]}.rank{rank}.json", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
