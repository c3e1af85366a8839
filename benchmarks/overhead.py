"""hybridsync with no strategy vs Horovod, same 2-rank model, interleaved rounds in one job.

    .venv/bin/python benchmarks/overhead.py            # launches itself under horovodrun -np 2 --gloo
    OVERHEAD_MODEL=sparse .venv/bin/python benchmarks/overhead.py   # dropin_cluster.py's wide & deep model
    sudo OVERHEAD_CLUSTER=horovodrun_configs/cluster_2x2_1gbit.yaml .venv/bin/python benchmarks/overhead.py
        # the same job on the emulated cluster of that config (all its slots, Gloo launcher)
    OVERHEAD_FRAMEWORK=tensorflow [OVERHEAD_TF_API=keras] [OVERHEAD_TF_EAGER=1] [OVERHEAD_MODEL=sparse] \
        .venv/bin/python benchmarks/overhead.py     # sparse: an embedding's IndexedSlices and two Dense layers
    sudo OVERHEAD_FRAMEWORK=tensorflow OVERHEAD_MODEL=deep OVERHEAD_CLUSTER=... \
        OVERHEAD_TF_STRATEGY='{"version": 1, "default": {"route": "allreduce", "algorithm": "hierarchical"}}' \
        .venv/bin/python benchmarks/overhead.py     # a 28 MB Keras model, two more copies under that strategy

On the emulated cluster a PyTorch job's ``HYBRIDSYNC_WAIT`` is ``spin`` unless set (a user's default, where
the cluster's launchers default to ``sleep``); with ``sleep`` Horovod's optimizer waits through
``hybridsync.backends.waiting.wait`` too, as in ``dropin_cluster.py``.

Three copies of one model of ~50 parameter tensors are trained in rotating order, round
by round: Horovod's DistributedOptimizer (built first), hybridsync's (built second) and
Horovod's again (built last). The order a model is built in shifted its step time by a
few % here, so hybridsync sits between the two Horovod copies, and the two Horovod copies
against each other (the A/A ratio) show the run's own noise floor. Prints the median
per-step time of each and the ratio hybridsync / Horovod (both Horovod copies pooled), and
the CPU time of rank 0's training thread per step: on a loaded machine a step's wall time
mostly measures the other jobs, while the thread's CPU time is the work the step itself did
(the model's, the optimizer's and, while a wait spins, the wait's).

``OVERHEAD_FRAMEWORK=tensorflow``: the same comparison for TensorFlow, on a Keras model of
the same 50 tensors trained by a ``tf.function`` step: Horovod's
``horovod.tensorflow.DistributedGradientTape`` (built first and last) against
``hybridsync.tensorflow.DistributedGradientTape`` (``OVERHEAD_TF_API=keras``: the two Keras
``DistributedOptimizer`` wrappers; ``OVERHEAD_TF_EAGER=1``: eager steps, a new tape each), under
``TF_USE_LEGACY_KERAS=1``. Both cores run in each
process (``hybridsync.tensorflow.horovod_core``). TensorFlow runs a step on its executor's
threads, so the CPU column is the process's CPU time per step (both Horovod cores included).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from unittest import mock

from provenance import print_header
from steps import timed_steps

ROUNDS = int(os.environ.get("OVERHEAD_ROUNDS", "15"))
ROUND_STEPS = int(os.environ.get("OVERHEAD_STEPS", "20"))
MODEL = os.environ.get("OVERHEAD_MODEL", "mlp")
"""``mlp`` (below), or ``sparse`` / ``dense``: the wide & deep model of ``dropin_cluster.py``."""
CLUSTER = os.environ.get("OVERHEAD_CLUSTER", "")
"""A cluster config (YAML): run on that emulated cluster instead of 2 local ranks."""
FRAMEWORK = os.environ.get("OVERHEAD_FRAMEWORK", "torch")
"""``torch`` or ``tensorflow``."""
TF_API = os.environ.get("OVERHEAD_TF_API", "tape")
"""TensorFlow only: ``tape`` (``DistributedGradientTape``) or ``keras`` (the Keras ``DistributedOptimizer``)."""
TF_EAGER = os.environ.get("OVERHEAD_TF_EAGER", "") == "1"
"""TensorFlow only: run each step eagerly (no ``tf.function``), a new tape every step, as an eager loop does."""
TF_STRATEGY = os.environ.get("OVERHEAD_TF_STRATEGY", "")
"""TensorFlow only: a strategy (JSON text or file) for two more copies trained after hybridsync's:
``strategy`` under it, and ``one-call`` under it with ``HYBRIDSYNC_TF_OVERLAP_BYTES=0`` (the bridge's
single call after the backward pass): e.g. one that keeps the bridge, to see what its overlap gains."""
NAMES = ("horovod", "hybridsync", *(("strategy", "one-call") if FRAMEWORK == "tensorflow" and TF_STRATEGY else ()),
         "horovod-2")


def build_model():
    import torch.nn as nn
    if MODEL in ("sparse", "dense"):
        from dropin_cluster import build_model as wide_and_deep
        return wide_and_deep(sparse=MODEL == "sparse")
    layers = []
    for i in range(25):  # 25 Linear layers = 50 parameter tensors, 256x256 each (~6.6 MB in all)
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers)


def worker() -> None:
    import horovod.torch as hvd
    import torch
    import hybridsync as hs
    from hybridsync.backends import waiting
    hvd.init()
    waiting.use_for_horovod(hvd)  # HYBRIDSYNC_WAIT=sleep: Horovod's optimizer waits as hybridsync's does
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if MODEL == "mlp":
        data = [(torch.randn(32, 256), torch.randn(32, 256)) for _ in range(ROUND_STEPS)]
    else:
        data = [(torch.randint(0, 100_000, (64, 26)), torch.randn(64)) for _ in range(ROUND_STEPS)]
    runs = {}
    makers = {"horovod": hvd.DistributedOptimizer, "hybridsync": hs.DistributedOptimizer,
              "horovod-2": hvd.DistributedOptimizer}
    for name in NAMES:
        torch.manual_seed(0)
        model = build_model()  # one model per optimizer: each optimizer's hooks stay on its own model
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = makers[name](torch.optim.SGD(model.parameters(), lr=1e-4), named_parameters=model.named_parameters())
        runs[name] = (lambda opt=opt, model=model: timed_steps(opt, model, data))
        runs[name]()  # warm-up: threads, caches, fusion buffers
    tensors = len(list(model.parameters()))
    report(rotate(runs, time.thread_time), hvd.rank(), f"model: {MODEL} ({tensors} parameter tensors)",
           f"{hvd.size()} ranks (Gloo)", "thread CPU")


def tensorflow_worker() -> None:
    """The comparison for TensorFlow: three Keras copies of the 50-tensor MLP, one ``tf.function`` step each."""
    import tensorflow as tf
    import horovod.torch as hvd_torch
    import hybridsync.tensorflow as hst
    from hybridsync import envvars
    from hybridsync.tensorflow.horovod_core import horovod_tensorflow
    hst.init()
    hvd = horovod_tensorflow(hvd_torch)  # Horovod's TensorFlow core, beside hybridsync's
    tf.random.set_seed(0)
    data = _keras_batches(tf)
    runs = {}
    for name in NAMES:
        frontend = hvd if name.startswith("horovod") else hst
        runs[name] = _tensorflow_run(frontend, data, TF_STRATEGY if name in ("strategy", "one-call") else None)
        # one-call: no overlap, read when its bridge is built (in this first step), the user's setting after it
        with mock.patch.dict(os.environ, {envvars.TF_OVERLAP_BYTES: "0"} if name == "one-call" else {}):
            runs[name]()  # warm-up: traces, threads, fusion buffers
    report(rotate(runs, time.process_time), hvd.rank(),
           f"model: keras {MODEL} ({_keras_model_size(tf)}), "
           f"{TF_API} API{', eager' if TF_EAGER else ''}, TensorFlow {tf.__version__}",
           f"{hvd.size()} ranks (Gloo)", "process CPU", wait="sleep (hybridsync.tensorflow's default)")
    hvd_torch.barrier()  # no rank leaves while another still waits in a collective


TF_MODELS = {"mlp": (256, 25), "deep": (768, 12)}
"""TensorFlow's ``OVERHEAD_MODEL``: (width, Dense layers). ``deep``: 28 MB of gradients (issue 24 §4)."""
TF_SPARSE = (20_000, 64, 16, 512)
"""``OVERHEAD_MODEL=sparse`` for TensorFlow: (vocabulary, embedding width, ids per example, Dense width),
a user's eager two-tower loop: an ``Embedding`` (its gradient ``IndexedSlices``, all-gathered by Horovod)
mean-pooled into two ``Dense`` layers and a scalar output."""


def _keras_model(tf):
    if MODEL == "sparse":
        vocabulary, dim, ids, width = TF_SPARSE
        # named, so that OVERHEAD_TF_STRATEGY can name the embedding in every copy
        inputs = tf.keras.Input((ids,), dtype="int32")
        x = tf.keras.layers.Embedding(vocabulary, dim, name="embedding")(inputs)
        x = tf.keras.layers.GlobalAveragePooling1D()(x)
        for i in range(2):
            x = tf.keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(x)
        return tf.keras.Model(inputs, tf.keras.layers.Dense(1, name="out")(x))
    width, layers = TF_MODELS[MODEL]
    return tf.keras.Sequential([tf.keras.Input((width,))] + [tf.keras.layers.Dense(width, activation="relu")
                                                             for _ in range(layers)])


def _keras_batches(tf) -> list:
    """``ROUND_STEPS`` (inputs, target) batches of 32 for ``_keras_model``."""
    if MODEL == "sparse":
        vocabulary, _, ids, _ = TF_SPARSE
        return [(tf.random.uniform((32, ids), 0, vocabulary, dtype=tf.int32), tf.random.normal((32, 1)))
                for _ in range(ROUND_STEPS)]
    width, _ = TF_MODELS[MODEL]
    return [(tf.random.normal((32, width)), tf.random.normal((32, width))) for _ in range(ROUND_STEPS)]


def _keras_model_size(tf) -> str:
    variables = _keras_model(tf).trainable_variables
    return f"{len(variables)} variables, {sum(4 * int(tf.size(v)) for v in variables) / 1e6:.1f} MB"


def _tensorflow_run(frontend, data, strategy):
    """A function timing one round of steps of a fresh Keras MLP synchronized by ``frontend``'s
    tape (``horovod.tensorflow`` or ``hybridsync.tensorflow``, with ``strategy``) or Keras optimizer (``TF_API``)."""
    import json

    import tensorflow as tf
    tf.random.set_seed(0)
    model = _keras_model(tf)
    optimizer = tf.keras.optimizers.SGD(1e-4)
    extra = {} if strategy is None else {"strategy": json.loads(strategy) if strategy.startswith("{") else strategy}
    if TF_API == "keras":
        keras = __import__(f"{frontend.__name__}.keras", fromlist=["DistributedOptimizer"])
        optimizer = keras.DistributedOptimizer(optimizer, **extra)
    frontend.broadcast_variables(model.variables, root_rank=0)

    def step(inputs, target):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(inputs) - target))
        if TF_API == "keras":
            # minimize, as Keras' fit does: Horovod 0.28.1's Keras optimizer all-reduces in compute_gradients,
            # and its apply_gradients alone (a custom loop) does not all-reduce under tf_keras 2.21's optimizers.
            optimizer.minimize(loss, model.trainable_variables, tape=tape)
            return loss
        tape = frontend.DistributedGradientTape(tape, **extra)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    if not TF_EAGER:
        step = tf.function(step)

    def timed() -> list[float]:
        times = []
        for inputs, target in data:
            start = time.perf_counter()
            step(inputs, target).numpy()
            times.append(time.perf_counter() - start)
        return times
    return timed


def rotate(runs, cpu_clock):
    """Per run: the median step of each round and its CPU time per step (``cpu_clock``), the runs
    taking turns in rotating order, round by round."""
    per_step: dict[str, list[float]] = {name: [] for name in NAMES}
    cpu_per_step: dict[str, list[float]] = {name: [] for name in NAMES}
    for r in range(ROUNDS):
        for name in NAMES[r % len(NAMES):] + NAMES[:r % len(NAMES)]:
            cpu = cpu_clock()
            times = runs[name]()
            per_step[name].append(statistics.median(times))
            cpu_per_step[name].append((cpu_clock() - cpu) / len(times))
    return per_step, cpu_per_step


def report(measured, rank: int, model: str, world: str, cpu_label: str, wait: str = "spin") -> None:
    """Rank 0 prints each run's median step and CPU, the A/A ratio and hybridsync / Horovod (pooled)."""
    if rank != 0:
        return
    per_step, cpu_per_step = measured
    median = {name: statistics.median(times) for name, times in per_step.items()}
    cpu = {name: statistics.median(times) for name, times in cpu_per_step.items()}
    hv = statistics.median(per_step["horovod"] + per_step["horovod-2"])
    hv_cpu = statistics.median(cpu_per_step["horovod"] + cpu_per_step["horovod-2"])
    print(f"{model}, {ROUNDS} rotating rounds x {ROUND_STEPS} steps, {world}, "
          f"HYBRIDSYNC_WAIT={os.environ.get('HYBRIDSYNC_WAIT', wait)}")
    for name in NAMES:
        print(f"{name:<10} median step {median[name] * 1e3:8.2f} ms   {cpu_label} {cpu[name] * 1e3:7.2f} ms")
    print(f"A/A ratio horovod-2/horovod = {median['horovod-2'] / median['horovod']:.3f}  (noise floor)"
          f"   CPU {cpu['horovod-2'] / cpu['horovod']:.3f}")
    print(f"ratio hybridsync/horovod = {median['hybridsync'] / hv:.3f}  (target <= 1.03)"
          f"   CPU {cpu['hybridsync'] / hv_cpu:.3f}")
    for name in ("strategy", "one-call"):
        if name in median:
            print(f"ratio {name}/horovod = {median[name] / hv:.3f}   CPU {cpu[name] / hv_cpu:.3f}")


def main() -> None:
    if FRAMEWORK == "tensorflow":
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # benchmarks/tensorflow.py is not TensorFlow
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        os.environ["TF_USE_LEGACY_KERAS"] = "1"  # Horovod 0.28.1's tape and Keras optimizer need Keras 2
    if os.environ.get("HOROVOD_RANK") is not None or os.environ.get("OMPI_COMM_WORLD_RANK") is not None:
        tensorflow_worker() if FRAMEWORK == "tensorflow" else worker()
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print_header()
    print("settings:", " ".join(f"{k}={v!r}" for k, v in sorted(os.environ.items()) if k.startswith("OVERHEAD_")))
    if CLUSTER:
        sys.exit(on_emulated_cluster(CLUSTER))
    from hybridsync.run.procs import run_bounded
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    proc = run_bounded([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                        os.path.abspath(__file__)], timeout=900)
    print(proc.stdout)
    sys.exit(proc.returncode)


def on_emulated_cluster(config: str) -> int:
    """Run the worker on every slot of the emulated cluster ``config`` (as root); rank 0's output."""
    import subprocess
    import tempfile

    from hybridsync.cluster import ClusterSpec, EmulatedCluster
    from hybridsync.run.emulated import launch_gloo
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = ClusterSpec.from_yaml(config)
    env = {"PYTHONPATH": repo, "OMP_NUM_THREADS": "1"}
    if FRAMEWORK == "torch" or "HYBRIDSYNC_WAIT" in os.environ:  # TensorFlow: the front end's own default
        env["HYBRIDSYNC_WAIT"] = os.environ.get("HYBRIDSYNC_WAIT", "spin")
    with EmulatedCluster(spec) as cluster, tempfile.TemporaryFile("w+") as log:
        print(f"cluster: {spec.nodes} hosts x {spec.workers_per_node} ranks, {spec.inter_node_bandwidth} uplinks")
        job = launch_gloo(cluster, [sys.executable, os.path.abspath(__file__)], env=env, stdout=log,
                          stderr=subprocess.STDOUT)
        codes = job.wait(timeout=1800)
        log.seek(0)
        lines = log.read().splitlines()
    print("\n".join(line for line in lines if any(key in line for key in ("model:", "median step", "ratio"))))
    if any(codes):
        print("\n".join(lines[-40:]))
    return max(codes, key=abs)


if __name__ == "__main__":
    main()
