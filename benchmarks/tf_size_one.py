"""One process, one Keras step: hybridsync.tensorflow's passthrough at size 1 against its machinery.

    python benchmarks/tf_size_one.py [--steps 200] [--rounds 5]

At size 1 Horovod's TensorFlow ops skip their collectives; hybridsync.tensorflow's bridge then
passes the gradients through (``GradientBridge.passthrough``). This times ``train_on_batch`` of
the same Keras MLP under three optimizers in one process, interleaved round by round: plain
Keras, hybridsync's Keras optimizer (passthrough), and hybridsync's with the passthrough
switched off (every step through the ``numpy_function``, the torch mirrors and the optimizer,
as before). Prints the medians of the per-round median step times and the ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# This folder's tensorflow.py (the TensorFlow benchmark) would shadow TensorFlow itself.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hybridsync.tensorflow as hst  # noqa: E402
from hybridsync.tensorflow import bridge  # noqa: E402
from hybridsync.tensorflow import keras as hst_keras  # noqa: E402


def make_model() -> tf.keras.Model:
    tf.keras.utils.set_random_seed(3)
    inputs = tf.keras.Input(shape=(256,))
    hidden = inputs
    for i in range(6):
        hidden = tf.keras.layers.Dense(512, activation="relu", name=f"dense{i}")(hidden)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(1, name="out")(hidden))


def compiled(kind: str) -> tf.keras.Model:
    model = make_model()
    optimizer = tf.keras.optimizers.SGD(0.01)
    if kind != "keras":
        optimizer = hst_keras.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def machinery_model() -> tf.keras.Model:
    """hybridsync's Keras optimizer with every bridge's passthrough off (what size 1 ran before)."""
    original = bridge.GradientBridge.__init__

    def without_passthrough(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.passthrough = False

    bridge.GradientBridge.__init__ = without_passthrough
    try:
        model = compiled("hybridsync")
        model.train_on_batch(*batch())  # builds the bridge (and traces the step) now
    finally:
        bridge.GradientBridge.__init__ = original
    return model


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 256)).astype(np.float32), rng.normal(size=(64, 1)).astype(np.float32)


def step_ms(model: tf.keras.Model, steps: int) -> float:
    x, y = batch()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    hst.init()
    models = {"keras": compiled("keras"), "passthrough": compiled("hybridsync"), "machinery": machinery_model()}
    for model in models.values():
        step_ms(model, 20)  # warm-up: trace and build
    rounds: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            rounds[name].append(step_ms(model, args.steps))
    median = {name: statistics.median(values) for name, values in rounds.items()}
    for name, values in rounds.items():
        print(f"{name:12s} median {median[name]:.3f} ms/step  rounds {', '.join(f'{v:.3f}' for v in values)}")
    print(f"machinery / passthrough: {median['machinery'] / median['passthrough']:.3f}; "
          f"passthrough / plain Keras: {median['passthrough'] / median['keras']:.3f}")


if __name__ == "__main__":
    main()
