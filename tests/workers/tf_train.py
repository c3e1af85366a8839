"""Trains a small Keras model (dense layers and a sparse embedding) on each rank's shard of
seeded data, with hybridsync.tensorflow or horovod.tensorflow, and saves every rank's
final variables.

    python tf_train.py OUT_PREFIX --impl hybridsync|horovod|single --api tape|tape-function|keras-fit|keras-loop
                       [--steps N] [--compression none|fp16] [--sparse-as-dense] [--optimizer sgd|adam]
                       [--passes N [--average-aggregated]] [--unused] [--sync-switch-report]

``OUT_PREFIX.rank<r>.npz`` gets the variables by name (and ``OUT_PREFIX.rank<r>.json`` a
summary). ``--impl single`` runs one process on the whole batch (every rank's shard at once):
with a mean loss and plain SGD, that is what averaging the ranks' gradients must give.
Strategies come from ``HYBRIDSYNC_STRATEGY``, as in any job.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

ROWS, FEATURES, EMBED, VOCAB, BATCH = 64, 12, 6, 50, 16


def make_model() -> tf.keras.Model:
    tf.keras.utils.set_random_seed(7)
    ids = tf.keras.Input(shape=(2,), dtype="int32", name="ids")
    dense_in = tf.keras.Input(shape=(FEATURES,), name="dense_in")
    embedded = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(VOCAB, EMBED, name="embedding")(ids))
    hidden = tf.keras.layers.Dense(32, activation="relu", name="hidden")(
        tf.keras.layers.Concatenate()([embedded, dense_in]))
    out = tf.keras.layers.Dense(1, name="out")(hidden)
    return tf.keras.Model([ids, dense_in], out)


def data(step: int, rank: int, size: int) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """Batch ``step`` of rank ``rank`` (``rank=None``: every rank's shard, in rank order)."""
    rng = np.random.default_rng(1000 + step)
    ids = rng.integers(0, VOCAB, size=(BATCH * size, 2)).astype(np.int32)
    dense = rng.normal(size=(BATCH * size, FEATURES)).astype(np.float32)
    target = (dense[:, :1] * 0.5 + (ids[:, :1] % 7) * 0.1).astype(np.float32)
    part = slice(None) if rank is None else slice(rank * BATCH, (rank + 1) * BATCH)
    return (ids[part], dense[part]), target[part]


def make_optimizer(name: str):
    if name == "adam":
        return tf.keras.optimizers.Adam(0.01)
    return tf.keras.optimizers.SGD(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("prefix")
    parser.add_argument("--impl", choices=["hybridsync", "horovod", "single"], required=True)
    parser.add_argument("--api", choices=["tape", "tape-function", "keras-fit", "keras-loop"], required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--compression", choices=["none", "fp16"], default="none")
    parser.add_argument("--sparse-as-dense", action="store_true")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--size", type=int, default=2, help="--impl single: how many ranks' shards per batch")
    parser.add_argument("--switch-to", help="keras APIs: optimizer.set_strategy(this file) at --switch-at")
    parser.add_argument("--switch-at", type=int, default=0)
    parser.add_argument("--passes", type=int, default=1,
                        help="backward_passes_per_step (tape APIs: hybridsync only, Horovod's tape has none)")
    parser.add_argument("--average-aggregated", action="store_true", help="keras APIs: average_aggregated_gradients")
    parser.add_argument("--unused", action="store_true",
                        help="tape APIs: one more variable, outside the model, whose gradient is None")
    parser.add_argument("--sync-switch-report", action="store_true",
                        help="hybridsync keras: report the Sync-Switch switches and the learning rate in ASP "
                             "and after a final set_strategy to the ring")
    args = parser.parse_args()

    if args.impl == "hybridsync":
        import hybridsync.tensorflow as hvd
        from hybridsync.tensorflow import keras as hvd_keras
    elif args.impl == "horovod":
        import horovod.tensorflow as hvd
        import horovod.tensorflow.keras as hvd_keras
    if args.impl == "single":
        rank, size, shard = 0, args.size, None
    else:
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        shard = rank
    compression = None if args.impl == "single" else (hvd.Compression.fp16 if args.compression == "fp16"
                                                       else hvd.Compression.none)
    model = make_model()
    optimizer = make_optimizer(args.optimizer)
    loss_fn = tf.keras.losses.MeanSquaredError()
    extra = {"sparse_as_dense": args.sparse_as_dense} if args.impl != "single" else {}

    if args.passes > 1 and args.impl == "hybridsync" and not args.api.startswith("keras"):
        extra["backward_passes_per_step"] = args.passes
    if args.api.startswith("keras"):
        if args.impl != "single":
            if args.passes > 1:
                extra.update(backward_passes_per_step=args.passes,
                             average_aggregated_gradients=args.average_aggregated)
            optimizer = hvd_keras.DistributedOptimizer(optimizer, compression=compression, **extra)
    model((np.zeros((1, 2), np.int32), np.zeros((1, FEATURES), np.float32)))  # create the variables

    tapes = []
    # A variable the loss does not use: its gradient is None, on every rank.
    trained = model.trainable_variables + ([tf.Variable(tf.ones(3), name="unused")] if args.unused else [])

    def tape_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if args.impl != "single" and not args.api.startswith("keras"):
            tape = hvd.DistributedGradientTape(tape, compression=compression, **extra)
            tapes.append(tape)
        grads = tape.gradient(loss, trained)
        optimizer.apply_gradients((g, v) for g, v in zip(grads, trained) if g is not None)
        return loss

    if args.api == "keras-fit":
        model.compile(optimizer=optimizer, loss=loss_fn)
        if args.impl != "single":
            hvd.broadcast_variables(model.variables, root_rank=0)
        for step in range(args.steps):
            if args.switch_to and step == args.switch_at:
                optimizer.set_strategy(args.switch_to)  # between steps, on every rank
            x, y = data(step, shard, size)
            model.fit(x, y, batch_size=len(y), epochs=1, verbose=0, shuffle=False)
    else:
        step_fn = tf.function(tape_step) if args.api == "tape-function" else tape_step
        if args.impl != "single":
            hvd.broadcast_variables(model.variables, root_rank=0)
        for step in range(args.steps):
            x, y = data(step, shard, size)
            step_fn(x, y)

    if args.impl == "hybridsync" and args.api.startswith("keras"):
        hvd.barrier()  # every rank's last push is in: ASP/SSP variables then agree across ranks
        optimizer.pull_parameters()
    x, y = data(10_000, None, size)  # one held-out batch, the same for every rank and job
    final_loss = float(loss_fn(y, model(x, training=False)))
    names = [getattr(v, "path", None) or v.name for v in model.trainable_variables]
    np.savez(f"{args.prefix}.rank{rank}.npz", **{n.replace("/", "|"): v.numpy() for n, v in
                                                 zip(names, model.trainable_variables)})
    summary = {"rank": rank, "size": size, "names": names, "tensorflow": tf.__version__, "loss": final_loss,
               "iterations": int(optimizer.iterations.numpy())}
    if args.sync_switch_report:
        controller = optimizer.strategy_bridges[0].optimizer.sync_controller
        summary["switches"] = [[event.step, event.protocol] for event in controller.switches]
        summary["lr_at_end"] = float(optimizer.learning_rate.numpy())
        optimizer.set_strategy({"version": 1})  # every variable ring all-reduced: the user's rate again
        summary["lr_after_set_strategy"] = float(optimizer.learning_rate.numpy())
    if args.impl == "hybridsync":  # how each message really travelled: the strategy is in force
        bridges = optimizer.strategy_bridges if args.api.startswith("keras") else list(tapes[-1]._bridges)
        summary["messages"] = sorted(f"{m.config.route_name}:{','.join(p.var_name for p in m.pieces)}"
                                     for b in bridges for m in b.optimizer.plan.messages)
        summary["horovod_ring"] = [b.horovod_ring for b in bridges]  # the plan runs on Horovod's ops (graph or eager)
        summary["bridged_passes"] = sum(b.bridged_passes for b in bridges)  # and the passes that did not
        summary["overlapped_groups"] = sum(b.overlapped_groups for b in bridges)  # handed over during backward
        if tapes:  # an eager loop's tapes (one per step) share their bridges: one torch optimizer in all
            summary["tape_bridges"] = len({id(b) for tape in tapes for b in tape._bridges})
    with open(f"{args.prefix}.rank{rank}.json", "w") as out:
        json.dump(summary, out)


if __name__ == "__main__":
    main()
