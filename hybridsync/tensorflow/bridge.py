"""TensorFlow gradients through hybridsync's runtime: torch mirrors of the variables.

The router, its backends (ring, hierarchical, parameter server), the strategy, the
Sync-Switch controller, the profiler and trials-in-a-script all run on torch tensors
inside ``hybridsync.DistributedOptimizer``. A TensorFlow model reaches them through a
``GradientBridge``: one torch parameter (a *mirror*) per TensorFlow variable, under the
variable's name, wrapped by a real ``DistributedOptimizer`` whose own update does nothing
(TensorFlow's optimizer applies the update). A step hands TensorFlow's gradients to the
mirrors through ``torch.autograd.backward``, so the optimizer's gradient hooks, its
``backward_passes_per_step`` count and its router run exactly as for a torch model, and
reads the synchronized gradients back. ``tf.IndexedSlices`` become sparse torch
gradients (touched rows only on the parameter server, Horovod's sparse all-reduce on
the ring) and come back as ``tf.IndexedSlices``.

Variables on the parameter server under ASP/SSP exchange parameters, not gradients:
after TensorFlow's update, ``after_update`` copies them into their mirrors, lets the
optimizer push and pull, and assigns the servers' values back.

Where Horovod's TensorFlow ops skip their collectives (one rank, or a rank outside the process
set) and nothing else rides along (no profiler, no elastic job that may grow, one backward pass
per step), the bridge is a *passthrough*: ``synchronize`` returns the gradients as they are and
``after_update`` does nothing, without a ``numpy_function`` or a torch conversion.

Inside ``tf.function`` (and Keras' ``fit``), a plan that Horovod's TensorFlow ops express exactly
syncs with those ops, in the graph (``horovod_ops.py``): ranks vote on it when the bridge is built
and at each Keras ``set_strategy``; a Keras optimizer's traced step reads the vote's outcome from a
variable at each run, a tape's is fixed when traced (nothing can change its plan).

Otherwise, inside ``tf.function`` (and Keras' ``fit``) both calls run as ``tf.numpy_function``: the
synchronization is real Python at run time, not a traced graph, which is also why
XLA-compiled steps (``jit_compile=True``) are refused. ``numpy_function`` rather than
``py_function``: it hands over NumPy arrays without wrapping each in an eager tensor (what that
saves: benchmarks/RESULTS.md, "tensorflow.py"); a step's conversions run on a core that the other
ranks of a CPU job may be waiting for. ``synchronize`` overlaps the backward pass as Horovod's ops
do: one ``numpy_function`` per group of gradients (about ``HYBRIDSYNC_TF_OVERLAP_BYTES``, in backward
order) hands its group to the mirrors as soon as TensorFlow's executor has computed it, so the
optimizer's hooks start the messages it completes and the backends communicate while the earlier
layers' gradients are computed; one last ``numpy_function`` waits and returns every gradient. Under
the profiler (which times the whole backward pass) one call takes them all after the backward pass.
What crosses between TensorFlow and torch is copied once each way at most (``layout.py``).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import tensorflow as tf
import torch

from hybridsync import envvars
from hybridsync.hooks import end_run
from hybridsync.tensorflow.horovod_ops import (HorovodRing, agreed, eager_zeros, options_allow, present_anywhere,
                                               plan_expressed, shared_gradients)
from hybridsync.tensorflow.layout import Layout, backward_groups, numpy_parts, torch_gradient
from hybridsync.tensorflow.names import variable_names
from hybridsync.horovod_options import SyncOptions
from hybridsync.tensorflow.options import refuse_dynamic_sync
from hybridsync.world import elastic_job

_BRIDGE_NUMBERS = itertools.count()
"""Names the ops of each bridge on Horovod's ring: every rank builds its bridges in the same order."""

def _densified(gradients: Sequence[Any]) -> list[Any]:
    """``gradients`` with each ``tf.IndexedSlices`` made a dense tensor (``sparse_as_dense``)."""
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in gradients]


TORCH_DTYPES = {tf.float16: torch.float16, tf.bfloat16: torch.bfloat16, tf.float32: torch.float32,
                tf.float64: torch.float64}


class StepFollower(Protocol):
    """What the Keras optimizer does after each update the bridge ended (``after_update``)."""

    def follow(self, optimizer: Any) -> None:
        """``optimizer`` (the bridge's torch ``DistributedOptimizer``) just ended a step: carry what
        its step hooks changed (Sync-Switch's learning-rate scale, a switch) over to TensorFlow."""


class _ExternalUpdate(torch.optim.Optimizer):
    """The optimizer under the mirrors: TensorFlow applies the update, so ``step()`` does nothing.

    Its ``lr`` is 1.0: a factor, not a value. Sync-Switch's controller scales it as it scales a
    torch optimizer's; a ``StepFollower`` applies it to the Keras optimizer. It has no ``momentum``,
    so the controller leaves momentum alone (the Keras optimizer refuses a ``momentum_scale`` it
    could not apply)."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 1.0})

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        return None


class GradientBridge:
    """Synchronizes the gradients of one fixed list of TensorFlow variables by a strategy."""

    def __init__(self, variables: Sequence[tf.Variable], options: SyncOptions, *, allow_parameter_exchange: bool,
                 owner: str, follower: StepFollower | None = None, watched: Sequence[tf.Variable] = ()) -> None:
        """``allow_parameter_exchange``: whether the caller runs ``after_update`` after each update
        (the Keras optimizer does; a gradient tape never sees the update, so ASP/SSP and the
        dynamic ``sync`` policies are refused). ``follower``: told after each update (Keras).
        ``watched``: the script's other variables the caller saw (a tape's watched ones), which a
        strategy may name for another bridge not built yet."""
        from hybridsync.optimizer import wrap
        self.variables = list(variables)
        unknown = [v.name for v in self.variables
                   if tf.as_dtype(v.dtype) not in TORCH_DTYPES or not tf.TensorShape(v.shape).is_fully_defined()]
        if unknown:
            raise ValueError(f"{owner}: hybridsync synchronizes floating-point variables of a known shape; "
                             f"not these: {', '.join(unknown)}")
        self.names = variable_names(self.variables)
        self.mirrors = [torch.nn.Parameter(torch.zeros(tuple(v.shape), dtype=TORCH_DTYPES[tf.as_dtype(v.dtype)]))
                        for v in self.variables]
        mirror_of = {id(v): m for v, m in zip(self.variables, self.mirrors)}
        self.optimizer = wrap(_ExternalUpdate(self.mirrors), list(zip(self.names, self.mirrors)),
                              dataclasses.replace(options, groups=_groups_of_mirrors(options.groups, mirror_of)),
                              frontend="tensorflow", known_elsewhere=variable_names(list(watched)) if watched else ())
        self._owner = owner
        self._allow_parameter_exchange = allow_parameter_exchange
        self._follower = follower
        self._sparse_as_dense = options.sparse_as_dense
        self._overlap_bytes = envvars.int_from_env(envvars.TF_OVERLAP_BYTES, envvars.TF_OVERLAP_BYTES_DEFAULT, 0)
        """Bytes per group handed over during the backward pass in a graph (0: all at once, after it)."""
        self.check_plan()
        self._backward_start: float | None = None
        self._passes = 0
        self.bridged_passes = 0
        """Backward passes whose gradients went through the torch runtime (not Horovod's ops) so far."""
        self.overlapped_groups = 0
        """Groups of gradients handed to the runtime while a graph's backward pass ran, so far."""
        process_set = self.optimizer.process_set
        self._presence_vote = f"hybridsync.tf.presence.{next(_BRIDGE_NUMBERS)}"
        """The name of this bridge's per-step count of the ranks that have each gradient (a tape's)."""
        self.passthrough = (options.backward_passes_per_step == 1 and self.optimizer.profiler is None
                            and not elastic_job() and not (process_set.included() and process_set.size() > 1))
        """Nothing to synchronize and nothing riding along: gradients pass as they are (Horovod's
        ``tf.cond`` on the size). Decided once, as Horovod decides when the step is traced."""
        self._horovod: HorovodRing | None = None
        """Horovod's own ops, for a graph whose plan they express (``horovod_ops.py``); ``None``: never."""
        self._switch: tf.Variable | None = None
        """Whether a graph runs Horovod's ops or the bridge, read at each step: a Keras optimizer's plan
        may change (``set_strategy``) after its step is traced. A tape's is decided when traced."""
        self.horovod_ring = False
        """The current plan syncs by Horovod's ops, in a graph or eagerly (every rank agreed)."""
        allowed = expressed = False
        if not self.passthrough:
            allowed, expressed = agreed(options_allow(options, self.optimizer),
                                        plan_expressed(self.optimizer.plan, self.optimizer.step_hooks))
        if allowed:
            # A tape's plan never changes (trials and the profiler, which switch or time it, keep it off
            # Horovod's ops): Horovod's TensorFlow core starts only if its ops will run.
            if expressed or allow_parameter_exchange:
                self._horovod = HorovodRing(options, prefix=f"hybridsync.tf.{next(_BRIDGE_NUMBERS)}")
                # Eagerly each op would run alone and wait, one gradient at a time; traced, they run together
                # and Horovod fuses them (Horovod's tape does the same eagerly). Traced per pattern of Nones.
                self._horovod_eager = tf.function(
                    lambda gradients, zeros: self._horovod.allreduce_all(gradients, self.variables, self.names, zeros))
                self.horovod_ring = expressed
            if allow_parameter_exchange:
                with tf.init_scope():
                    self._switch = tf.Variable(self.horovod_ring, trainable=False, name="hybridsync_horovod_ring")

    # --- the two calls of a step -------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def synchronize(self, gradients: Sequence[Any]) -> list[Any]:
        """Each variable's gradient averaged (or summed) across ranks by the strategy. A ``None`` gradient
        takes part with zeros (so no rank waits for it); a tape's ranks count those that have one: ``None``
        where no rank has a gradient; where some have one, eagerly the reduced gradient on every rank (all
        update the variable alike), in a graph through the torch runtime (``None`` fixed when traced) an
        error on every rank. With
        ``backward_passes_per_step`` > 1 the gradients of the passes in between are accumulated
        locally and returned as they are, as Horovod's local aggregation does."""
        gradients = list(gradients)
        if len(gradients) != len(self.mirrors):
            raise ValueError(f"{self._owner}: {len(gradients)} gradients for {len(self.mirrors)} variables")
        if self.passthrough:
            # as Horovod, which densifies before its size test
            return _densified(gradients) if self._sparse_as_dense else gradients
        if tf.executing_eagerly():
            if self.horovod_ring:  # Horovod's ops, as Horovod runs them eagerly: in a function of their own
                gradients = _densified(gradients) if self._sparse_as_dense else gradients
                return shared_gradients(*self._horovod_eager(gradients, eager_zeros(gradients, self.variables)))
            synced = self._synchronize_now(gradients)
            self._end_if_run_finished()
            return synced
        if self._horovod is not None and self._sparse_as_dense:  # as Horovod's tape, before anything else
            gradients = _densified(gradients)
        if self._horovod is not None and self._switch is None and self.horovod_ring:
            return self._horovod.allreduce(gradients, self.variables, self.names)
        layout = Layout(gradients)
        flat = layout.flatten(gradients)
        if self._switch is not None and flat:
            synced = tf.cond(self._switch,
                             lambda: layout.flatten(self._horovod.allreduce(gradients, self.variables, self.names)),
                             lambda: self._bridged(gradients, flat, layout), name="hybridsync_route")
        else:
            synced = self._bridged(gradients, flat, layout)
        for tensor, original, dense in zip(synced, flat, layout.dense_flags):
            # A sparse all-reduce gathers every rank's rows: only the row shape is known.
            tensor.set_shape(original.shape if dense else [None, *original.shape[1:]])
        return layout.rebuild(synced)

    def _bridged(self, gradients: list[Any], flat: list[tf.Tensor], layout: Layout) -> list[tf.Tensor]:
        """The graph's ``tf.numpy_function`` calls handing the gradients to the torch runtime and back.

        Overlapped (``_overlap_bytes`` > 0, no profiler): one call per group of gradients, in backward
        order, each only handing its group to the mirrors (their hooks start the messages it completes,
        the backends communicate in their threads while TensorFlow computes the earlier layers'
        gradients), then one call that waits for everything and returns it. Each group's call runs as
        soon as its gradients exist, after the previous group's (explicit control dependencies: the
        runtime is not thread-safe, and every rank must start its messages in the same order).
        Otherwise one call takes every gradient once the backward pass is done."""
        dtypes = [t.dtype for t in flat]
        numpy_dtypes = [t.dtype.as_numpy_dtype for t in flat]
        if not self._overlap_bytes or self.optimizer.profiler is not None:
            synced = tf.numpy_function(
                self._graph_body(lambda *arrays: self._synchronize_arrays(arrays, layout, numpy_dtypes)), flat,
                dtypes, stateful=True, name="hybridsync_synchronize")
            return list(synced) if flat else []  # no gradient at all: the rank still takes part, with zeros
        handed: list[tf.Tensor] = []
        for group in backward_groups(gradients, self._overlap_bytes):
            part = Layout([gradients[i] for i in group])
            inputs = part.flatten([gradients[i] for i in group])
            with tf.control_dependencies(handed[-1:]):
                handed.append(tf.numpy_function(lambda *arrays, group=group, part=part: self._hand_arrays(
                    arrays, group, part), inputs, tf.bool, stateful=True, name="hybridsync_hand"))
        synced = tf.numpy_function(self._graph_body(lambda *_: self._finish_arrays(layout, numpy_dtypes)), handed,
                                   dtypes, stateful=True, name="hybridsync_synchronize")
        return list(synced) if flat else []

    def refresh_route(self) -> None:
        """Decide again (collective, after ``set_strategy`` on every rank) whether the plan runs on
        Horovod's ops: a traced step reads the decision at its next run."""
        if self._horovod is None:
            return
        self.horovod_ring, = agreed(plan_expressed(self.optimizer.plan, self.optimizer.step_hooks))
        if self._switch is not None:
            self._switch.assign(self.horovod_ring)

    @tf.autograph.experimental.do_not_convert
    def after_update(self, after: Sequence[Any] = ()) -> tf.Tensor | None:
        """After TensorFlow applied this step's update: the ASP/SSP variables push their update and take
        the servers' values; then the optimizer's end-of-step work (Sync-Switch, profiling, trials).

        In a graph, ``after``: tensors it must run after. Inside a ``tf.cond`` branch (the Keras
        optimizer's accumulation) they are needed: there, automatic control dependencies did not
        order it after the step's ``synchronize``, and it ran first."""
        if self.passthrough:
            return None
        if tf.executing_eagerly():
            if self.horovod_ring:  # nothing went through the torch optimizer (nor rides along)
                return None
            self._after_update_now()
            self._end_if_run_finished()
            return None
        def bridged() -> tf.Tensor:
            return tf.numpy_function(self._graph_body(lambda: self._after_update_now() or np.True_), [], tf.bool,
                                     stateful=True, name="hybridsync_after_update")

        with tf.control_dependencies(list(after)):
            if self._switch is None:
                return bridged()
            return tf.cond(self._switch, lambda: tf.constant(True), bridged, name="hybridsync_after_update_route")

    def pull_parameters(self) -> None:
        """The ASP/SSP variables take the servers' current values, pushing nothing (eagerly). Called on
        every rank once every rank's last update is pushed (after a barrier), it leaves every rank
        with the same model, as at the end of training."""
        exchanged = self._parameter_exchanging()
        self.optimizer.pull_parameters()
        for index in exchanged:
            self.variables[index].assign(self.mirrors[index].detach().numpy())

    def mark_backward_start(self) -> None:
        """The backward pass starts now (only the profiler cares)."""
        profiler = self.optimizer.profiler
        if profiler is not None:
            self._backward_start = profiler.now()

    # --- the bodies: eager, or inside the graph's numpy_function ------------------------------
    def _synchronize_arrays(self, arrays: Sequence[np.ndarray], layout: Layout,
                            dtypes: Sequence[np.dtype]) -> list[np.ndarray]:
        """The body of the graph's one ``tf.numpy_function`` (not overlapped): NumPy in, NumPy out, as
        few conversions as possible (they run on every step, on a core the other ranks may be waiting for)."""
        synced = self._synchronize_torch(layout.to_torch(arrays, self.mirrors), in_graph=True)
        return layout.to_arrays(synced, dtypes, copy=bool(self._passes))

    def _hand_arrays(self, arrays: Sequence[np.ndarray], group: Sequence[int], layout: Layout) -> np.ndarray:
        """The body of an overlapped group's ``tf.numpy_function``: the mirrors ``group`` take their
        gradients (``arrays``, laid out by ``layout``); their hooks start what they complete."""
        mirrors = [self.mirrors[i] for i in group]
        self._hand(mirrors, layout.to_torch(arrays, mirrors))
        self.overlapped_groups += 1
        return np.True_

    def _finish_arrays(self, layout: Layout, dtypes: Sequence[np.dtype]) -> list[np.ndarray]:
        """The body of the overlapped step's last ``tf.numpy_function``, after every group's: the pass
        ends (``_finish_pass``), its gradients return as NumPy."""
        synced = self._finish_pass(layout.present, in_graph=True)
        return layout.to_arrays(synced, dtypes, copy=bool(self._passes))

    def _synchronize_now(self, gradients: list[Any]) -> list[Any]:
        synced = self._synchronize_torch([None if g is None else _to_torch(g, m)
                                          for m, g in zip(self.mirrors, gradients)], in_graph=False)
        return [None if g is None else _to_tensorflow(g) for g in synced]

    def _synchronize_torch(self, gradients: list[torch.Tensor | None], in_graph: bool) -> list[torch.Tensor | None]:
        """The mirrors take ``gradients`` (one per variable, ``None`` for none), the strategy
        synchronizes them; returns each mirror's gradient (``None`` where no rank gave one: ``_finish_pass``)."""
        profiler = self.optimizer.profiler
        if profiler is not None:
            profiler.record_backward(self._backward_start, profiler.now(), self.names)
            self._backward_start = None
        present = [(m, g) for m, g in zip(self.mirrors, gradients) if g is not None]
        self._hand([m for m, _ in present], [g for _, g in present])
        return self._finish_pass([g is not None for g in gradients], in_graph)

    @staticmethod
    def _hand(mirrors: list[torch.nn.Parameter], gradients: list[torch.Tensor]) -> None:
        """``mirrors`` take ``gradients``: accumulated into their ``grad`` by autograd, whose
        ``AccumulateGrad`` copies a gradient still referenced (``gradients`` is), so the runtime never
        writes into TensorFlow's memory; the optimizer's hooks mark them ready."""
        if mirrors:
            torch.autograd.backward(mirrors, gradients)
        assert not any(not g.is_sparse and g.numel() and m.grad.data_ptr() == g.data_ptr()
                       for m, g in zip(mirrors, gradients)), "a mirror's gradient is TensorFlow's buffer"

    def _finish_pass(self, present: Sequence[bool], in_graph: bool) -> list[torch.Tensor | None]:
        """A backward pass whose gradients the mirrors hold ends: on the ``backward_passes_per_step``-th
        the strategy synchronizes them. Returns each mirror's gradient: on a synchronizing pass, the
        reduced one wherever any rank gave one (``present``: this rank's; the runtime sent zeros for the
        others), so every rank updates the same variables alike; else where ``present``.

        ``in_graph``: inside a traced step, whose ``None`` gradients are fixed when traced: a gradient
        some ranks have and others not is a ``ValueError`` on every rank instead."""
        self.bridged_passes += 1
        self._passes += 1
        given = list(present)
        if self._passes >= self.optimizer.backward_passes_per_step:
            self._passes = 0
            self.optimizer.synchronize()
            if not self._allow_parameter_exchange:  # a tape (Keras' apply_gradients drops None gradients)
                given = present_anywhere(given, self.names, in_graph=in_graph, vote_name=self._presence_vote,
                                         process_set=self.optimizer.process_set)
        synced = [m.grad if any_rank else None for m, any_rank in zip(self.mirrors, given)]
        if not self._passes and not self._allow_parameter_exchange:
            self._end_step()  # a tape never sees the update: its step ends with its gradients
        return synced

    def _after_update_now(self) -> None:
        if self._passes:
            return  # an accumulating pass: nothing was synchronized, nothing ends
        exchanged = self._parameter_exchanging()
        for index in exchanged:
            self.mirrors[index].data.copy_(torch.from_numpy(np.asarray(self.variables[index].numpy())))
        self._end_step()
        # Only what exchanged this step: a plan switched in by step() (trials) joins the servers at the
        # next step, from the values copied above then; its mirrors hold nothing yet.
        for index in exchanged:
            self.variables[index].assign(self.mirrors[index].detach().numpy())
        self.follow()

    def follow(self) -> None:
        """Let the follower carry the torch optimizer's step hooks' changes over (also after ``set_strategy``)."""
        if self._follower is not None:
            self._follower.follow(self.optimizer)

    def _end_step(self) -> None:
        """The optimizer's ``step()`` without synchronizing again, then clear the mirrors' gradients."""
        with self.optimizer.skip_synchronize():
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.check_plan()  # a trial schedule may have switched strategies in step()

    def _end_if_run_finished(self, in_graph: bool = False) -> None:
        """End the process if a step hook ended the run in this step (a finished profile or trial
        schedule), as torch's ``step()`` does (``end_run``); ``in_graph``: inside a ``tf.numpy_function``."""
        if self.optimizer.run_finished:
            end_run(from_tensorflow_graph=in_graph)

    def _graph_body(self, body: Callable[..., Any]) -> Callable[..., Any]:
        """``body`` for ``tf.numpy_function``, ending the process after it if the run is over."""
        def run(*args: Any) -> Any:
            result = body(*args)
            self._end_if_run_finished(in_graph=True)
            return result
        return run

    def _parameter_exchanging(self) -> set[int]:
        """Variables whose messages exchange parameters (ASP/SSP on the servers) under the current plan."""
        plan = self.optimizer.plan
        return {piece.var_index for message in plan.messages if message.exchanges_parameters
                for piece in message.pieces}

    def check_plan(self) -> None:
        """``ValueError`` for a plan this caller cannot run: ``rows`` variables; when nothing calls
        ``after_update`` (a tape), a dynamic ``sync`` policy or ASP/SSP variables."""
        rows = sorted({piece.var_name for message in self.optimizer.plan.messages for piece in message.pieces
                       if piece.rows})
        if rows:
            raise ValueError(f"{self._owner}: variables {', '.join(rows[:5])}{' ...' if len(rows) > 5 else ''} have "
                             f"`rows`, which the TensorFlow front end does not support: TensorFlow's embedding "
                             f"gradients are tf.IndexedSlices already and travel as their rows without it; "
                             f"drop `rows` from the strategy")
        if self._allow_parameter_exchange:
            return
        refuse_dynamic_sync(self.optimizer.strategy)  # a strategy switched in by set_strategy (trials)
        exchanging = self._parameter_exchanging()
        if exchanging:
            names = sorted(self.names[i] for i in exchanging)
            raise ValueError(f"{self._owner}: variables {', '.join(names[:5])}{' ...' if len(names) > 5 else ''} "
                             f"are on the parameter server under ASP/SSP, which exchange parameters after the "
                             f"update; a gradient tape never sees the update. Use "
                             f"hybridsync.tensorflow.keras.DistributedOptimizer (it also serves custom loops "
                             f"through apply_gradients) or the bsp protocol")


class Bridges:
    """One ``GradientBridge`` per distinct list of variables (a GAN's two lists get one each), built
    on first use under the caller's options: what a tape and a Keras optimizer both keep."""

    def __init__(self, options: SyncOptions, *, allow_parameter_exchange: bool, owner: str,
                 follower: Callable[[], StepFollower] | None = None, keep: int | None = None) -> None:
        """``follower``: makes each bridge's ``StepFollower`` (the Keras optimizer's). ``keep``: at most
        this many bridges, the least recently used dropped (``None``: every one)."""
        self.options = options
        self._allow_parameter_exchange = allow_parameter_exchange
        self._owner = owner
        self._follower = follower
        self._keep = keep
        self._built: dict[tuple[int, ...], GradientBridge] = {}
        """By the ids of the variables (the bridge holds them: their ids stay theirs), in the order
        built; with ``keep``, least recently used first."""

    def for_variables(self, variables: Sequence[tf.Variable],
                      watched: Callable[[], Sequence[tf.Variable]] = tuple) -> GradientBridge:
        """The bridge of ``variables``, built on first use (``watched()``: ``GradientBridge``'s, asked only then)."""
        key = tuple(id(v) for v in variables)
        if key in self._built:
            if self._keep is not None:  # the most recently used last
                self._built[key] = self._built.pop(key)
            return self._built[key]
        # Built on every rank in the same order: the optimizer's construction is collective.
        self._built[key] = GradientBridge(variables, self.options, owner=self._owner,
                                          allow_parameter_exchange=self._allow_parameter_exchange,
                                          follower=None if self._follower is None else self._follower(),
                                          watched=watched())
        if self._keep is not None and len(self._built) > self._keep:
            del self._built[next(iter(self._built))]
        return self._built[key]

    def __iter__(self) -> Iterator[GradientBridge]:
        return iter(list(self._built.values()))


def scaled(gradient: Any, factor: float) -> Any:
    """``gradient`` (dense, ``tf.IndexedSlices`` or ``None``) times ``factor``."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices, gradient.dense_shape)
    return gradient * factor


def _groups_of_mirrors(groups: Any, mirror_of: dict[int, torch.nn.Parameter]) -> Any:
    """Horovod's ``groups`` (a count, or lists of variables) with each TensorFlow variable replaced by its mirror."""
    if not isinstance(groups, list):
        return groups
    try:
        return [[mirror_of[id(v)] for v in group] for group in groups]
    except KeyError:
        raise ValueError("groups: every variable in a group must be one whose gradient is synchronized") from None


def torch_copy(value: Any) -> torch.Tensor:
    """A TensorFlow tensor's (or variable's) value as a torch tensor with memory of its own: what
    a collective or the router writes into it never reaches TensorFlow's buffer."""
    return torch.from_numpy(np.array(value.numpy()))


def _to_torch(gradient: Any, mirror: torch.nn.Parameter) -> torch.Tensor:
    """An eager TensorFlow gradient (dense or ``IndexedSlices``) as a torch gradient of its own."""
    if isinstance(gradient, tf.IndexedSlices):
        return torch_gradient(mirror, gradient.values.numpy(), gradient.indices.numpy())
    return torch_gradient(mirror, tf.convert_to_tensor(gradient).numpy())


def _to_tensorflow(gradient: torch.Tensor) -> Any:
    parts = [tf.convert_to_tensor(part) for part in numpy_parts(gradient)]
    if gradient.is_sparse:
        return tf.IndexedSlices(*parts, tf.constant(list(gradient.shape), dtype=tf.int64))
    return parts[0]
