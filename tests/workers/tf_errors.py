"""Bad inputs to hybridsync.tensorflow, each caught and reported: ``python tf_errors.py OUT.json``.

One process (``hvd.init()`` alone makes a job of one rank); writes ``{case: message}``, the
message of the exception each case raised (or ``"no error"``), and under ``"size_one"`` what
a Keras job of one rank did: whether its bridge passed the gradients through, and how far its
weights ended from plain Keras'. With ``--disagree``, under a
2-rank launcher: each rank builds a tape with another strategy, and writes
``OUT.rank<r>.json`` with the error and how long it took to come.
"""
from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import hybridsync.tensorflow as hst  # noqa: E402
from hybridsync.tensorflow import keras as hst_keras  # noqa: E402


def model() -> tf.keras.Model:
    inputs = tf.keras.Input(shape=(4,))
    return tf.keras.Model(inputs, tf.keras.layers.Dense(2, name="dense")(inputs))


def gradient(net: tf.keras.Model, variables=None, **tape_options) -> None:
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(net(tf.ones((3, 4))))
    tape = hst.DistributedGradientTape(tape, **tape_options)
    tape.gradient(loss, variables if variables is not None else net.trainable_variables)


def cases(net: tf.keras.Model) -> dict:
    counter = tf.Variable(3, dtype=tf.int32, name="counter")
    return {
        "unknown_variable": lambda: gradient(net, strategy={"variables": {"dense/nope": {"route": "ps"}}}),
        "bad_strategy_key": lambda: gradient(net, strategy={"variables": {"dense/kernel": {"route": "carrier-pigeon"}}}),
        "tape_asp": lambda: gradient(net, strategy={"default": {"route": "ps", "protocol": "asp"}}),
        "dynamic_sync": lambda: gradient(net, strategy={"default": {"route": "ps"},
                                                        "sync": {"policy": "switch", "switch_at": 10}}),
        "op_adasum": lambda: gradient(net, op=hst.Adasum),
        "predivide_with_sum": lambda: gradient(net, op=hst.Sum, gradient_predivide_factor=2.0),
        "passes_zero": lambda: gradient(net, backward_passes_per_step=0),
        "compression_by_name": lambda: gradient(net, compression="fp16"),
        "keras_passes_zero": lambda: hst_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                                                    backward_passes_per_step=0),
        "keras_switch_with_schedule": lambda: hst_keras.DistributedOptimizer(
            tf.keras.optimizers.SGD(tf.keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)),
            strategy={"default": {"route": "ps"}, "sync": {"policy": "switch", "switch_at": 10}}),
        "keras_switch_momentum_scale": lambda: hst_keras.DistributedOptimizer(
            tf.keras.optimizers.SGD(0.1, momentum=0.9),
            strategy={"default": {"route": "ps"}, "sync": {"policy": "switch", "switch_at": 10,
                                                           "momentum_scale": 0.5}}),
        "integer_variable": lambda: gradient(net, variables=[*net.trainable_variables, counter]),
        "missing_strategy_file": lambda: gradient(net, strategy="/nonexistent/strategy.json"),
        "rows": lambda: gradient(net, strategy={"variables": {"dense/kernel": {"route": "allreduce", "rows": True}}}),
    }


def size_one() -> dict:
    """The same 3 ``fit`` steps with plain Keras and with hybridsync's Keras optimizer, on one rank."""
    weights, bridges = [], []
    for wrap in (False, True):
        tf.keras.utils.set_random_seed(5)
        net = model()
        optimizer = tf.keras.optimizers.SGD(0.1)
        if wrap:
            optimizer = hst_keras.DistributedOptimizer(optimizer)
        net.compile(optimizer=optimizer, loss="mse")
        for step in range(3):
            net.fit(tf.ones((3, 4)) * step, tf.ones((3, 2)), batch_size=3, epochs=1, verbose=0)
        weights.append([v.numpy() for v in net.trainable_variables])
        bridges = optimizer.strategy_bridges if wrap else bridges
    return {"passthrough": [b.passthrough for b in bridges],
            "max_difference": max(float(abs(a - b).max()) for a, b in zip(*weights))}


def main(out: str) -> None:
    hst.init()
    net = model()
    net(tf.ones((1, 4)))
    report: dict = {"size_one": size_one()}
    for name, case in cases(net).items():
        try:
            case()
            report[name] = "no error"
        except Exception as error:  # noqa: BLE001 - every message is the test's to read
            report[name] = f"{type(error).__name__}: {error}"
    with open(out, "w") as file:
        json.dump(report, file, indent=1)


def disagree(prefix: str) -> None:
    hst.init()
    net = model()
    net(tf.ones((1, 4)))
    partitions = 2 if hst.rank() == 0 else 1
    start = time.monotonic()
    try:
        gradient(net, strategy={"variables": {"dense/kernel": {"partitions": partitions}}})
        error = "no error"
    except Exception as raised:  # noqa: BLE001
        error = f"{type(raised).__name__}: {raised}"
    with open(f"{prefix}.rank{hst.rank()}.json", "w") as file:
        json.dump({"error": error, "seconds": time.monotonic() - start}, file)


if __name__ == "__main__":
    if "--disagree" in sys.argv:
        disagree(sys.argv[1])
    else:
        main(sys.argv[1])
