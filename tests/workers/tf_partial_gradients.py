"""Run under ``horovodrun -np 2 --gloo``: a gradient that only rank 0 has (a layer only rank 0's forward pass
uses), with ``hybridsync.tensorflow.DistributedGradientTape``, on Horovod's ops (no strategy) and through the
bridge (a strategy merging two variables), eagerly and inside ``tf.function``.

Usage: python tf_partial_gradients.py OUT_PREFIX -> OUT_PREFIX.rank<R>.json: per route, ``eager``
{"diff_across_ranks", "extra_moved", "unused_moved", "seconds"} (Adam, 3 steps; ``unused``: a variable no rank
has a gradient for) and, bridged only, ``traced`` {"error", "seconds"} (the step's error, or {"diff_across_ranks"} if none).
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.torch as hvd_torch  # noqa: E402
import hybridsync.tensorflow as hst  # noqa: E402
from hybridsync.tensorflow.names import variable_names  # noqa: E402

STEPS = 3


def model_and_variables() -> tuple[tf.keras.Model, tf.keras.layers.Layer, tf.Variable, list]:
    tf.keras.utils.set_random_seed(hst.rank())  # the ranks start apart: the broadcast must bring them together
    model = tf.keras.Sequential([tf.keras.Input(shape=(6,)), tf.keras.layers.Dense(8, activation="tanh", name="hidden"),
                                 tf.keras.layers.Dense(3, name="out")])
    extra = tf.keras.layers.Dense(3, name="extra")
    extra.build((None, 3))
    unused = tf.Variable(tf.ones((2, 2)), name="unused")
    variables = [*model.trainable_variables, *extra.trainable_variables, unused]
    hst.broadcast_variables(variables, root_rank=0)
    return model, extra, unused, variables


def strategy_for(route: str, variables: list) -> dict | None:
    if route == "horovod_ops":
        return None
    first, second = variable_names(variables)[:2]
    merged = {"route": "allreduce", "algorithm": "ring", "group": 1}
    return {"version": 1, "default": {"route": "allreduce", "algorithm": "ring"},
            "variables": {first: merged, second: merged}}


def diff_across_ranks(variables: list) -> float:
    theirs = hvd_torch.allgather_object([v.numpy() for v in variables])
    return max(float(np.abs(a - b).max()) for a, b in zip(*theirs))


def run(route: str, traced: bool) -> dict:
    model, extra, unused, variables = model_and_variables()
    strategy = strategy_for(route, variables)
    opt = tf.keras.optimizers.Adam(0.01)
    rng = np.random.default_rng(100 + hst.rank())

    def step(x, y):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = tf.reduce_mean((y - (extra(out) if hst.rank() == 0 else out)) ** 2)
        grads = hst.DistributedGradientTape(tape, strategy=strategy).gradient(loss, variables)
        opt.apply_gradients((g, v) for g, v in zip(grads, variables) if g is not None)

    step = tf.function(step) if traced else step
    extra_before = [v.numpy() for v in extra.trainable_variables]
    start = time.perf_counter()
    try:
        for _ in range(STEPS):
            step(rng.normal(size=(8, 6)).astype(np.float32), rng.normal(size=(8, 3)).astype(np.float32))
    except Exception as e:  # noqa: BLE001 - the test judges it
        return {"error": f"{type(e).__name__}: {e}"[:3000], "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    return {"diff_across_ranks": diff_across_ranks(variables), "seconds": seconds,
            "extra_moved": any(not np.array_equal(a, v.numpy())
                               for a, v in zip(extra_before, extra.trainable_variables)),
            "unused_moved": not np.array_equal(unused.numpy(), np.ones((2, 2), np.float32))}


def main() -> None:
    prefix = sys.argv[1]
    hst.init()
    faulthandler.dump_traceback_later(200, exit=True)  # the test's bound is longer: a hang shows its stacks
    results = {"horovod_ops": {"eager": run("horovod_ops", traced=False)},  # traced, it still hangs as Horovod's
               "bridged": {"eager": run("bridged", traced=False), "traced": run("bridged", traced=True)}}
    with open(f"{prefix}.rank{hst.rank()}.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
