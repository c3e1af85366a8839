"""Run under ``hybridsync-run --num-servers 2`` (2 ranks): TensorFlow/Keras training patterns of real
scripts, each trained with ``horovod.tensorflow`` (its tape, its Keras optimizer and callbacks), with
``hybridsync.tensorflow`` and no strategy, and with ``hybridsync.tensorflow`` and a mixed strategy (PS,
hierarchical, merge groups, partitions). Keras 2 or 3, as ``TF_USE_LEGACY_KERAS`` says.

Usage: python tf_dropin_patterns.py OUT_PREFIX [CASE ...] -> OUT_PREFIX.rank<R>.json, per case and variant
(``horovod``, ``none``, ``mixed``): {"diff_across_ranks", "diff_vs_horovod", "diff_vs_none"} (the largest
difference of the trained variables and the values a script reads, such as averaged metrics; a variant
compared with those before it that succeeded) or {"error", "trace"}; a variant Horovod cannot run
(it would hang) is {"skipped"}.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import tempfile
import traceback
from typing import Any, Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.torch as hvd_torch  # noqa: E402
import hybridsync.tensorflow as hst  # noqa: E402
from hybridsync.tensorflow import keras as hst_keras  # noqa: E402
from hybridsync.tensorflow.horovod_core import horovod_tensorflow  # noqa: E402
from hybridsync.tensorflow.keras.callbacks import variables_of  # noqa: E402
from hybridsync.tensorflow.names import variable_names  # noqa: E402

STEPS, BATCH, FEATURES, OUTPUTS = 4, 8, 6, 3
CASE_TIMEOUT_S = 150
KERAS = 2 if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else 3


class Api:
    """What a script imports (``hvd``: the TensorFlow module, ``hvd_keras``: the Keras one) and how it wraps
    its tapes and optimizers; with a strategy, the mixed one over ``variables`` (the script's whole model)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "horovod":
            import horovod.tensorflow as hvd
            import horovod.tensorflow.keras as hvd_keras
            self.hvd, self.hvd_keras = hvd, hvd_keras
        else:
            self.hvd, self.hvd_keras = hst, hst_keras

    def _strategy(self, variables: list | None) -> dict:
        if self.kind != "mixed":
            return {}
        assert variables is not None, "a mixed strategy names the model's variables"
        return {"strategy": mixed_strategy(variables)}

    def tape(self, tape: tf.GradientTape, variables: list | None = None, **options: Any) -> tf.GradientTape:
        return self.hvd.DistributedGradientTape(tape, **options, **self._strategy(variables))

    def optimizer(self, optimizer: Any, variables: list | None = None, **options: Any) -> Any:
        return self.hvd_keras.DistributedOptimizer(optimizer, **options, **self._strategy(variables))


def mixed_strategy(variables: list) -> dict:
    """``dropin_patterns.mixed_strategy`` (every route and shape, cycling) over TensorFlow variables."""
    from dropin_patterns import mixed_strategy as over_shapes
    return over_shapes([(name, tuple(v.shape)) for name, v in zip(variable_names(variables), variables)])


# --- models and data --------------------------------------------------------------------------------------
def mlp(prefix: str = "", inputs: int = FEATURES, outputs: int = OUTPUTS, built: bool = True) -> tf.keras.Model:
    """Two dense layers named ``<prefix>hidden`` and ``<prefix>out``, each rank starting from its own values
    (a script that forgets to broadcast trains its ranks apart)."""
    layers = [tf.keras.layers.Dense(8, activation="tanh", name=f"{prefix}hidden"),
              tf.keras.layers.Dense(outputs, name=f"{prefix}out")]
    model = tf.keras.Sequential(([tf.keras.Input(shape=(inputs,))] if built else []) + layers)
    if built:
        rank_values(model.variables)
    return model


def rank_values(variables: list) -> None:
    rng = np.random.default_rng(10 + hst.rank())
    for v in variables:
        v.assign((rng.normal(size=v.shape) * 0.4).astype(tf.as_dtype(v.dtype).as_numpy_dtype))


def batches(steps: int = STEPS, features: int = FEATURES, outputs: int = OUTPUTS) -> list[tuple[np.ndarray, np.ndarray]]:
    """This rank's batches (another rank's are others)."""
    rng = np.random.default_rng(100 + hst.rank())
    return [(rng.normal(size=(BATCH, features)).astype(np.float32),
             rng.normal(size=(BATCH, outputs)).astype(np.float32)) for _ in range(steps)]


def whole(steps: int = STEPS) -> tuple[np.ndarray, np.ndarray]:
    parts = batches(steps)
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


mse = tf.keras.losses.MeanSquaredError()


def traced_tape_steps(api: Api, model: tf.keras.Model, opt: Any, data: list, variables: list | None = None,
                      clip_norm: float | None = None, **tape_options: Any) -> None:
    """A tf.function step per batch of ``data``: the loss, the wrapped tape's gradients of ``variables``
    (the model's trainable ones by default), clipped to ``clip_norm`` if given, the ones not ``None`` applied."""
    variables = model.trainable_variables if variables is None else variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = mse(y, model(x, training=True))
        grads = api.tape(tape, variables, **tape_options).gradient(loss, variables)
        if clip_norm is not None:
            grads, _ = tf.clip_by_global_norm(grads, clip_norm)
        opt.apply_gradients((g, v) for g, v in zip(grads, variables) if g is not None)

    for x, y in data:
        step(x, y)


def broadcast(api: Api, *variable_lists: list) -> None:
    for variables in variable_lists:
        api.hvd.broadcast_variables(variables, root_rank=0)


# --- the patterns: each trains with ``api`` and returns the values to compare ------------------------------
def keras_example(api: Api) -> list:
    """Horovod's Keras example: SGD with momentum and an lr scaled by size, fit() with the broadcast, metric
    average and lr warm-up callbacks (every rank reads the averaged loss)."""
    model = mlp()
    hvd = api.hvd_keras  # the example imports horovod.tensorflow.keras as hvd
    opt = api.optimizer(tf.keras.optimizers.SGD(0.02 * hvd.size(), momentum=0.9), model.trainable_variables)
    model.compile(optimizer=opt, loss="mse")
    callbacks = [api.hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                 api.hvd_keras.callbacks.MetricAverageCallback(),
                 api.hvd_keras.callbacks.LearningRateWarmupCallback(initial_lr=0.02 * hvd.size(), warmup_epochs=2,
                                                                    steps_per_epoch=2)]
    x, y = whole()
    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    return [*model.trainable_variables, np.array(history.history["loss"])]


def keras_schedule_adam(api: Api) -> list:
    """fit() with Adam on an ExponentialDecay schedule, the broadcast callback, 2 epochs."""
    model = mlp()
    schedule = tf.keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=2, decay_rate=0.5)
    model.compile(optimizer=api.optimizer(tf.keras.optimizers.Adam(schedule), model.trainable_variables), loss="mse")
    x, y = whole()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[api.hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    return model.trainable_variables


def keras_lr_schedule_callback(api: Api) -> list:
    """fit() with Horovod's LearningRateScheduleCallback (x0.5 per epoch from epoch 1), momentum corrected."""
    model = mlp()
    model.compile(optimizer=api.optimizer(tf.keras.optimizers.SGD(0.05, momentum=0.5), model.trainable_variables),
                  loss="mse")
    x, y = whole()
    callbacks = [api.hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                 api.hvd_keras.callbacks.LearningRateScheduleCallback(initial_lr=0.05, multiplier=0.5, start_epoch=1)]
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    return model.trainable_variables


def keras_accumulate(api: Api) -> list:
    """fit() with ``backward_passes_per_step=2``, averaged."""
    model = mlp()
    api.hvd.broadcast_variables(model.variables, root_rank=0)
    opt = api.optimizer(tf.keras.optimizers.SGD(0.05), model.trainable_variables, backward_passes_per_step=2,
                        average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss="mse")
    x, y = whole()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model.trainable_variables


def train_on_batch_broadcast_after_first(api: Api) -> list:
    """train_on_batch, the model and optimizer variables broadcast after the first batch."""
    model = mlp()
    opt = api.optimizer(tf.keras.optimizers.Adam(0.01), model.trainable_variables)
    model.compile(optimizer=opt, loss="mse")
    for step, (x, y) in enumerate(batches()):
        model.train_on_batch(x, y)
        if step == 0:
            broadcast(api, model.variables, variables_of(opt))
    return model.trainable_variables


def tape_function_first_batch(api: Api) -> list:
    """Horovod's TF2 example: a tf.function step, tape wrapped, broadcast of the model and optimizer
    variables after the first apply_gradients, the loss averaged by hand with ``hvd.allreduce``."""
    model = mlp()
    opt = tf.keras.optimizers.SGD(0.05, momentum=0.9)

    @tf.function
    def step(x, y, first_batch):
        with tf.GradientTape() as tape:
            loss = mse(y, model(x, training=True))
        tape = api.tape(tape, model.trainable_variables)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            broadcast(api, model.variables, variables_of(opt))
        return api.hvd.allreduce(loss)

    losses = [step(x, y, i == 0) for i, (x, y) in enumerate(batches())]
    return [*model.trainable_variables, np.array(losses)]


def tape_eager(api: Api) -> list:
    """An eager loop, a tape wrapped every step; the loss summed by hand (``op=hvd.Sum``)."""
    model = mlp()
    broadcast(api, model.variables)
    opt = tf.keras.optimizers.SGD(0.05)
    losses = []
    for x, y in batches():
        with tf.GradientTape() as tape:
            loss = mse(y, model(x, training=True))
        tape = api.tape(tape, model.trainable_variables)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(api.hvd.allreduce(loss, op=api.hvd.Sum)))
    return [*model.trainable_variables, np.array(losses)]


def lazy_variables(api: Api) -> list:
    """A model without an input shape: its variables (and Adam's) are made in the first traced step;
    broadcast after it."""
    model = mlp(built=False)
    opt = tf.keras.optimizers.Adam(0.01)
    template = mlp()  # the same layer names, built: the names a strategy file gives
    template_names = template.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = mse(y, model(x, training=True))
        tape = api.tape(tape, template_names)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for i, (x, y) in enumerate(batches()):
        step(x, y)
        if i == 0:
            rank_values(model.variables)  # the first step started from Keras' initializers: make the ranks differ
            broadcast(api, model.variables, variables_of(opt))
    return model.trainable_variables


def gan(api: Api) -> list:
    """Two models, two optimizers, two tapes in one tf.function step."""
    generator, discriminator = mlp("gen_", inputs=4, outputs=FEATURES), mlp("disc_", outputs=1)
    both = generator.trainable_variables + discriminator.trainable_variables
    broadcast(api, generator.variables, discriminator.variables)
    g_opt, d_opt = tf.keras.optimizers.Adam(0.01), tf.keras.optimizers.Adam(0.01)
    bce = tf.keras.losses.BinaryCrossentropy(from_logits=True)

    @tf.function
    def step(real, noise):
        with tf.GradientTape() as g_tape, tf.GradientTape() as d_tape:
            fake = generator(noise, training=True)
            real_out, fake_out = discriminator(real, training=True), discriminator(fake, training=True)
            g_loss = bce(tf.ones_like(fake_out), fake_out)
            d_loss = bce(tf.ones_like(real_out), real_out) + bce(tf.zeros_like(fake_out), fake_out)
        g_tape, d_tape = api.tape(g_tape, both), api.tape(d_tape, both)
        g_grads = g_tape.gradient(g_loss, generator.trainable_variables)
        d_grads = d_tape.gradient(d_loss, discriminator.trainable_variables)
        g_opt.apply_gradients(zip(g_grads, generator.trainable_variables))
        d_opt.apply_gradients(zip(d_grads, discriminator.trainable_variables))

    rng = np.random.default_rng(200 + hst.rank())
    for x, _ in batches():
        step(x, rng.normal(size=(BATCH, 4)).astype(np.float32))
    return both


def clip_global_norm(api: Api) -> list:
    """``tf.clip_by_global_norm`` on the synchronized gradients (small: it clips)."""
    model = mlp()
    broadcast(api, model.variables)
    traced_tape_steps(api, model, tf.keras.optimizers.SGD(0.1), batches(), clip_norm=0.05)
    return model.trainable_variables


def none_gradient(api: Api) -> list:
    """A variable the loss never uses (its gradient is ``None`` on every rank), in a tf.function."""
    model = mlp()
    unused = tf.Variable(tf.ones((3, 2)), name="unused")
    variables = [*model.trainable_variables, unused]
    broadcast(api, model.variables)
    traced_tape_steps(api, model, tf.keras.optimizers.SGD(0.05), batches(), variables)
    return variables


def branch_on_rank0_only(api: Api) -> list:
    """Eager: a layer used only by rank 0's forward pass, so its gradient is ``None`` on rank 1 only
    (Horovod's tape all-reduces only the gradients it has: rank 0 would wait for rank 1 forever). hybridsync
    returns the reduced gradient on both ranks: both update the layer alike."""
    if api.kind == "horovod":
        raise Skip("Horovod's tape leaves rank 0 waiting for the gradient rank 1 does not have")
    model, extra = mlp(), tf.keras.layers.Dense(OUTPUTS, name="extra")
    extra.build((None, OUTPUTS))
    rank_values(extra.variables)
    variables = [*model.trainable_variables, *extra.trainable_variables]
    broadcast(api, variables)
    opt = tf.keras.optimizers.SGD(0.05)

    def step(x, y):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = mse(y, extra(out) if hst.rank() == 0 else out)
        grads = api.tape(tape, variables).gradient(loss, variables)
        opt.apply_gradients((g, v) for g, v in zip(grads, variables) if g is not None)

    for x, y in batches():
        step(x, y)
    return variables



def embedding_model(api: Api, sparse_as_dense: bool) -> list:
    ids = tf.keras.Input(shape=(2,), dtype="int32")
    embedded = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(20, 4, name="embedding")(ids))
    model = tf.keras.Model(ids, tf.keras.layers.Dense(OUTPUTS, name="out")(embedded))
    rank_values(model.variables)
    broadcast(api, model.variables)
    rng = np.random.default_rng(300 + hst.rank())
    data = [(rng.integers(0, 20, size=(BATCH, 2)).astype(np.int32), y) for _, y in batches()]
    traced_tape_steps(api, model, tf.keras.optimizers.SGD(0.1), data, sparse_as_dense=sparse_as_dense)
    return model.trainable_variables


def embedding_sparse(api: Api) -> list:
    """An embedding: ``tf.IndexedSlices`` gradients, all-reduced sparse."""
    return embedding_model(api, sparse_as_dense=False)


def embedding_sparse_as_dense(api: Api) -> list:
    """An embedding with ``sparse_as_dense=True``."""
    return embedding_model(api, sparse_as_dense=True)


def keras_fine_tune(api: Api) -> list:
    """Transfer learning as Keras' guide does it: the base frozen, fit(), the base unfrozen, compile() again
    with a new optimizer at a lower rate, fit()."""
    model = mlp()
    base = model.layers[0]
    api.hvd.broadcast_variables(model.variables, root_rank=0)
    x, y = whole()
    base.trainable = False
    model.compile(optimizer=api.optimizer(tf.keras.optimizers.SGD(0.05), model.variables), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    base.trainable = True
    model.compile(optimizer=api.optimizer(tf.keras.optimizers.SGD(0.01), model.variables), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model.trainable_variables


def tape_trainable_flip(api: Api) -> list:
    """Eager: the hidden layer frozen (``trainable = False``) for steps 1-2: the tape's sources change."""
    model = mlp()
    every = list(model.trainable_variables)
    broadcast(api, model.variables)
    opt = tf.keras.optimizers.SGD(0.05)
    for step, (x, y) in enumerate(batches()):
        model.layers[0].trainable = step not in (1, 2)
        with tf.GradientTape() as tape:
            loss = mse(y, model(x, training=True))
        variables = model.trainable_variables
        grads = api.tape(tape, every).gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
    return every


def mixed_dtypes(api: Api) -> list:
    """A float64 layer between float32 ones, in a tf.function."""
    model = tf.keras.Sequential([tf.keras.Input(shape=(FEATURES,)),
                                 tf.keras.layers.Dense(8, activation="tanh", name="hidden", dtype="float64"),
                                 tf.keras.layers.Dense(OUTPUTS, name="out", dtype="float32")])
    rank_values(model.variables)
    broadcast(api, model.variables)
    traced_tape_steps(api, model, tf.keras.optimizers.SGD(0.05), batches())
    return model.trainable_variables


def save_and_reload(api: Api) -> list:
    """fit(), rank 0 saves the model (optimizer included), every rank reloads it with ``hvd.load_model``
    (which wraps the saved optimizer) and fit() continues."""
    model = mlp()
    model.compile(optimizer=api.optimizer(tf.keras.optimizers.Adam(0.01), model.trainable_variables), loss="mse")
    x, y = whole()
    callbacks = [api.hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)]
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    path = os.path.join(SAVE_DIR, f"model-{api.kind}.{'keras' if KERAS == 3 else 'h5'}")
    if hst.rank() == 0:
        model.save(path)
    hst.barrier()
    reloaded = api.hvd_keras.load_model(path)
    reloaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return reloaded.trainable_variables


def keras_optimizer_custom_loop(api: Api) -> list:
    """The Keras optimizer wrapped, in a custom tf.function loop (Horovod's averages nothing there: it
    synchronizes in fit()'s gradient computation only)."""
    model = mlp()
    broadcast(api, model.variables)
    opt = api.optimizer(tf.keras.optimizers.SGD(0.05), model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = mse(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for x, y in batches():
        step(x, y)
    return model.trainable_variables


class Skip(Exception):
    """A variant the pattern cannot run (it would hang)."""


CASES: dict[str, Callable[[Api], list]] = {f.__name__: f for f in (
    keras_example, keras_schedule_adam, keras_lr_schedule_callback, keras_accumulate,
    train_on_batch_broadcast_after_first, tape_function_first_batch, tape_eager, lazy_variables, gan,
    clip_global_norm, none_gradient, branch_on_rank0_only, embedding_sparse, embedding_sparse_as_dense,
    keras_fine_tune, tape_trainable_flip, mixed_dtypes, save_and_reload, keras_optimizer_custom_loop)}
SAVE_DIR = ""


def values_of(result: list) -> list[np.ndarray]:
    return [np.asarray(v.numpy() if hasattr(v, "numpy") else v, dtype=np.float64) for v in result]


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    if [x.shape for x in a] != [y.shape for y in b]:
        return float("inf")
    return max((float(np.abs(x - y).max()) for x, y in zip(a, b) if x.size), default=0.0)


def run_case(name: str) -> dict:
    out: dict[str, Any] = {}
    results: dict[str, list[np.ndarray]] = {}
    for kind in ("horovod", "none", "mixed"):
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
        try:
            tf.keras.backend.clear_session()
            tf.keras.utils.set_random_seed(hst.rank())  # Keras' initializers: the same in every variant
            results[kind] = values_of(CASES[name](Api(kind)))
            theirs = hvd_torch.allgather_object(results[kind])
            out[kind] = {"diff_across_ranks": max_diff(theirs[0], theirs[1])}
            for other in ("horovod", "none"):
                if other in results and other != kind:
                    out[kind][f"diff_vs_{other}"] = max_diff(results[kind], results[other])
        except Skip as e:
            out[kind] = {"skipped": str(e)}
        except Exception as e:  # noqa: BLE001 - recorded, the report judges it
            out[kind] = {"error": f"{type(e).__name__}: {e}"[:600], "trace": traceback.format_exc()[-3000:]}
        finally:
            faulthandler.cancel_dump_traceback_later()
        print(f"rank {hst.rank()} keras {KERAS} {name}/{kind}: "
              f"{json.dumps({k: v for k, v in out[kind].items() if k != 'trace'})}", flush=True)
    return out


def main() -> None:
    global SAVE_DIR
    prefix = sys.argv[1]
    hst.init()
    horovod_tensorflow(hvd_torch)  # horovod.tensorflow's core beside hybridsync's, for the Horovod variant
    with tempfile.TemporaryDirectory() as local:
        SAVE_DIR = hvd_torch.broadcast_object(local, root_rank=0)  # one host: rank 0's directory for all
        results = {name: run_case(name) for name in sys.argv[2:] or CASES}
        hst.barrier()
    with open(f"{prefix}.rank{hst.rank()}.json", "w") as f:
        json.dump({"keras": KERAS, "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
