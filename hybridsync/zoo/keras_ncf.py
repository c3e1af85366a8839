"""The zoo's NCF recommender in Keras, trained with ``hybridsync.tensorflow`` (or Horovod's TensorFlow).

    hybridsync-run -np 2 -H localhost:2 --gloo python -m hybridsync.zoo.keras_ncf --steps 100
    hybridsync-run --autotune --cluster spec.yaml -np 4 python -m hybridsync.zoo.keras_ncf
    hybridsync profile -o ncf-keras.json -- python -m hybridsync.zoo.keras_ncf

The same model as ``hybridsync.zoo.ncf`` (a GMF and an MLP tower over four embeddings of
100,000 users and 20,000 items, 15.6 MB, whose gradients are ``tf.IndexedSlices``: only touched
rows travel), the same popularity-skewed ids and latent-factor teacher, drawn with NumPy. Each
rank trains on its own batches with ``model.train_on_batch`` (a ``tf.function`` step, so the
synchronization runs inside the graph); rank 0 prints the median step time and the first and
last loss, and ``--json`` writes them with each rank's variable checksum.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

NUM_USERS, NUM_ITEMS, DIM, TEACHER_DIM = 100_000, 20_000, 16, 8
POPULARITY = 10.0
"""Ids are ``floor(n * u**POPULARITY)``, as in the PyTorch model: popular ids occur in most batches."""
HIDDEN = (256, 128, 64)


def build_model():
    """The Keras NCF model (variables named ``gmf_user/embeddings``, ``mlp_0/kernel``...)."""
    import tensorflow as tf
    pairs = tf.keras.Input(shape=(2,), dtype="int32", name="pairs")
    users, items = pairs[:, 0], pairs[:, 1]
    init = tf.keras.initializers.RandomNormal(stddev=0.1)

    def embedding(name: str, rows: int):
        return tf.keras.layers.Embedding(rows, DIM, embeddings_initializer=init, name=name)

    gmf = embedding("gmf_user", NUM_USERS)(users) * embedding("gmf_item", NUM_ITEMS)(items)
    mlp = tf.keras.layers.Concatenate()([embedding("mlp_user", NUM_USERS)(users),
                                         embedding("mlp_item", NUM_ITEMS)(items)])
    for index, width in enumerate(HIDDEN):
        mlp = tf.keras.layers.Dense(width, activation="relu", name=f"mlp_{index}")(mlp)
    logit = tf.keras.layers.Dense(1, name="predict")(tf.keras.layers.Concatenate()([gmf, mlp]))
    return tf.keras.Model(pairs, logit, name="ncf")


class Batches:
    """Seeded synthetic (user, item) pairs labelled by a fixed latent-factor teacher."""

    def __init__(self, seed: int, batch_size: int) -> None:
        teacher = np.random.default_rng(12345)
        self.users = teacher.standard_normal((NUM_USERS, TEACHER_DIM), dtype=np.float32)
        self.items = teacher.standard_normal((NUM_ITEMS, TEACHER_DIM), dtype=np.float32)
        self.users[:, 0], self.items[:, 0] = 1.0, 2.0 * self.items[:, 0]  # an item bias carries most signal
        self.rng = np.random.default_rng(seed)
        self.batch_size = batch_size

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        users = np.minimum((NUM_USERS * self.rng.random(self.batch_size) ** POPULARITY).astype(np.int32), NUM_USERS - 1)
        items = np.minimum((NUM_ITEMS * self.rng.random(self.batch_size) ** POPULARITY).astype(np.int32), NUM_ITEMS - 1)
        target = ((self.users[users] * self.items[items]).sum(1) > 0).astype(np.float32)
        return np.stack([users, items], axis=1), target[:, None]


def checksum(model) -> str:
    digest = hashlib.sha256()
    for variable in model.trainable_variables:
        digest.update(np.ascontiguousarray(variable.numpy()).tobytes())
    return digest.hexdigest()


def train(args: argparse.Namespace) -> int:
    import tensorflow as tf
    if args.optimizer == "horovod":
        import horovod.tensorflow.keras as hvd_keras
        import horovod.tensorflow as hvd
    else:
        import hybridsync.tensorflow as hvd
        from hybridsync.tensorflow import keras as hvd_keras
    hvd.init()
    tf.keras.utils.set_random_seed(args.seed)
    model = build_model()
    options = {} if args.optimizer == "horovod" else {"strategy": args.strategy}
    optimizer = hvd_keras.DistributedOptimizer(tf.keras.optimizers.Adam(args.lr), **options)
    model.compile(optimizer=optimizer, loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
    batches = Batches(args.seed * 1_000_003 + hvd.rank(), args.batch_size)
    step_seconds, losses = [], []
    for step in range(args.warmup + args.steps):
        pairs, target = batches.next()
        started = time.perf_counter()
        losses.append(float(model.train_on_batch(pairs, target)))
        step_seconds.append(time.perf_counter() - started)
        if step == 0:  # every variable exists now (Adam's slots too): start from rank 0's
            hvd.broadcast_variables(model.variables, root_rank=0)
            slots = optimizer.variables  # a method in Keras 2, a property in Keras 3
            hvd.broadcast_variables(slots() if callable(slots) else slots, root_rank=0)
    checksums = hvd.allgather_object(checksum(model))
    if hvd.rank() == 0:
        median = statistics.median(step_seconds[args.warmup:])
        print(f"keras ncf on {hvd.size()} ranks ({args.optimizer}): median step {1e3 * median:.1f} ms over "
              f"{args.steps} timed steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, ranks' variables "
              f"{'agree' if len(set(checksums)) == 1 else 'DIFFER'}", flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as out:
                json.dump({"ranks": hvd.size(), "median_step_s": median, "first_loss": losses[0],
                           "last_loss": losses[-1], "losses": losses, "step_seconds": step_seconds,
                           "checksums": checksums}, out, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridsync.zoo.keras_ncf", description=__doc__.replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=512, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", help="strategy file (default: HYBRIDSYNC_STRATEGY, else all-reduce)")
    parser.add_argument("--optimizer", choices=("hybridsync", "horovod"), default="hybridsync")
    parser.add_argument("--json", help="rank 0 writes step times, losses and checksums here")
    args = parser.parse_args(argv)
    if min(args.steps, args.batch_size) < 1 or args.warmup < 0:
        raise SystemExit("--steps and --batch-size must be >= 1, --warmup >= 0")
    if args.optimizer == "horovod" and args.strategy:
        raise SystemExit("--strategy needs --optimizer hybridsync (Horovod's optimizer ignores strategies)")
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
