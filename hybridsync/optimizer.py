"""The drop-in ``DistributedOptimizer``: Horovod's contract, per-variable routing underneath.

It keeps ``horovod.torch.DistributedOptimizer``'s names and behaviour (per-parameter
hooks, ``synchronize()``, ``skip_synchronize()``, ``step()``, the ``zero_grad()`` check,
``backward_passes_per_step``, ``op``, ``gradient_predivide_factor``, sparse gradients,
parameters that got no gradient), and hands each ready gradient to the router, which
sends it the way the strategy says. With no strategy every variable is its own ring
all-reduce under its own name: exactly what Horovod does.

What rides along a step (profiler, trial schedule, Sync-Switch controller) is a step hook
(``hybridsync.hooks``), called in a loop by ``synchronize()`` and ``step()``. What hybridsync's
own packages need of an optimizer is declared below ``set_strategy`` (``replace_plan``,
``pull_parameters``, ``plan_parameters``, ``close``, ``run_finished``); nothing outside this
module touches its underscored names.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import warnings
import weakref
from typing import Any, Iterable, Literal, Mapping

import torch

from hybridsync import envvars
from hybridsync.agreement import RankFacts, check_ranks_agree
from hybridsync.backends import Reduction, forget_world
from hybridsync.compression import Compression, compression_name
from hybridsync.hooks import BUILDER, StepHook, end_run
from hybridsync.frameworks import Average
from hybridsync.horovod_options import (SyncOptions, called_from_horovod_state_init, check_process_set,
                                        grouped_names, normalize_groups, strategy_with_groups, wrapped_step)
from hybridsync.router.plan import RoutingPlan, build_plan
from hybridsync.router.runtime import GradientKinds, Router, next_instance
from hybridsync.strategy import Strategy, resolve_strategy, unknown_variable_errors
from hybridsync.variables import variables_from_parameters
from hybridsync.world import current_world, elastic_job, fit_to_world


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixin whose ``__dict__`` becomes a subclass of the user's optimizer class (as Horovod does)."""

    _is_hybridsync = True

    def __init__(self, params, named_parameters, options: SyncOptions, frontend, known_elsewhere=()):
        super(self.__class__, self).__init__(params)
        import horovod.torch as hvd
        self._hvd = hvd
        named, aliases, spare = _checked_named_parameters(named_parameters, self.param_groups)
        self._spare_names = {id(p): name for name, p in spare}
        """Names given for parameters the optimizer did not hold: theirs if ``add_param_group`` adds them."""
        self._known_elsewhere = frozenset(known_elsewhere)
        """Variables of the script that another optimizer holds or will (``wrap``): not misspelt names."""
        self._named = named
        self._aliases = aliases
        """A tied parameter's later names (``named_parameters(remove_duplicate=False)``), each to the name its
        variable has: a strategy that names one is told which name to use."""
        _register_live(self)
        self._groups = None if options.groups is None else grouped_names(options.groups, self.param_groups,
                                                                         {p: name for name, p in named})
        """``groups`` as variable names: applied to every strategy this optimizer is given."""
        self._parameter_names = {p: name for name, p in named}
        self._params = [p for _, p in named]
        self.backward_passes_per_step = options.backward_passes_per_step
        self._allreduce_delay = {p: self.backward_passes_per_step for p in self._params}
        self._index = {p: i for i, p in enumerate(self._params)}
        self._fired: set[Any] = set()
        self._grad_accs: list[Any] = []
        self._synchronized = False
        self._should_synchronize = True
        self.sparse_as_dense = options.sparse_as_dense
        self._compression = options.compression
        self._process_set_option = options.process_set
        self._requested_strategy = options.strategy
        """The strategy as given (or to ``set_strategy``); ``rebuild_for_world`` fits it to each world."""
        self._elastic = elastic_job()
        self._all_built = frontend != "torch"
        """Every optimizer of the script is built: a strategy's variables that none holds are refused from
        then on. A torch script may build the one holding them after this one, so the first ``step()``
        sets it; hybridsync.tensorflow builds one per tape or Keras optimizer, for the variables it is
        given, and may never call ``step()`` (a one-rank job passes the gradients through): at once."""
        self.strategy, self.plan, self.process_set = self._plan_for(options.strategy)
        # As in Horovod, a rank outside the process set neither hooks nor synchronizes: it steps
        # locally; and an elastic job synchronizes with one rank too, ready for the world to grow.
        self._synchronizing = self.process_set.included() and (hvd.size() > 1 or self._elastic)
        self._reduction = _reduction(options.op, options.gradient_predivide_factor)
        self._kinds = GradientKinds()
        """Which gradients are sparse, as the ranks agreed: kept by every plan this optimizer runs."""
        self._router: Router | None = None
        """``None`` until the next step builds it (``_built_router``): in an elastic job, and after ``rebuild_for_world``."""
        if self._elastic:
            # Nothing collective here: the plan is fitted, agreed on and built at the first step, inside
            # hvd.elastic.run (a worker lost meanwhile is recoverable there), where after a reset the
            # ranks already running rebuild theirs, while a joining worker builds its own.
            self._check_elastic_process_set()
        else:
            self._router = Router(self.plan, self._params, compression=self._compression, reduction=self._reduction,
                                  process_set=self.process_set, sparse_as_dense=self.sparse_as_dense, kinds=self._kinds)
            if self._synchronizing and self.process_set.size() > 1:
                self._check_ranks_agree(self.strategy, self.plan, self.process_set, self._router.instance)
        if self._synchronizing:
            self._register_hooks()
        self._ends_run = frontend == "torch"
        """``step()`` ends the process when a hook ends the run; ``hybridsync.tensorflow`` ends it itself."""
        self.run_finished = False
        """A step hook ended the run at the last ``step()``: the front end ends the process (``end_run``)."""
        # hybridsync.tensorflow reports its backward pass to the profiler itself: no torch hook sees it.
        # The parameters named for later are profiled too: a fine-tuning script adds its head (add_param_group)
        # after the profile's few steps or during them, and a description without it would leave it unrouted.
        self._profiler = BUILDER.profiler_from_environment(named + spare, hvd.size(), torch_hooks=frontend == "torch")
        self._profile_hook = BUILDER.profile_hook()
        self._sync_controller = None if self._router is None else self._controller_for(options.strategy)
        self._trials = None
        self._hooks = self._step_hooks()
        if self._synchronizing:
            # None unless HYBRIDSYNC_TRIALS is set; switches to the schedule's first strategy now.
            self._trials = BUILDER.trials_from_environment(self, hvd)
            self._hooks = self._step_hooks()

    def _controller_for(self, strategy: Strategy | None) -> Any:
        """The Sync-Switch controller of ``strategy``'s dynamic ``sync`` policy (``None`` without one)."""
        if not self._synchronizing:
            return None
        return BUILDER.sync_controller(self, strategy, job=f"opt{self._router.instance}")

    def _use_controller(self, controller: Any) -> None:
        """Make ``controller`` the Sync-Switch hook: ``step()`` calls the hooks listed in ``_hooks``, so
        the list follows every change of controller (``set_strategy``, an elastic job's re-plan)."""
        self._sync_controller = controller
        self._hooks = self._step_hooks()

    def _step_hooks(self) -> tuple[StepHook, ...]:
        """The hooks ``step()`` calls, in order: the controller before the trials, which may switch plans."""
        return tuple(hook for hook in (self._profile_hook, self._sync_controller, self._trials) if hook is not None)

    @property
    def step_hooks(self) -> tuple[StepHook, ...]:
        """The hooks ``step()`` runs (profiler, Sync-Switch controller, trials); empty when none is active."""
        return self._hooks

    @property
    def sync_controller(self) -> Any:
        """The Sync-Switch controller (``hybridsync.hooks.syncswitch.SyncController``) or ``None``."""
        return self._sync_controller

    @property
    def profiler(self) -> Any:
        """The ``hybridsync.hooks.profiler.Profiler`` of this process when ``HYBRIDSYNC_PROFILE`` is set, else ``None``."""
        return self._profiler

    def _plan_for(self, strategy: Strategy | None) -> tuple[Strategy | None, RoutingPlan, Any]:
        """This optimizer's part of the strategy (``Strategy.restricted_to``: a strategy is for the whole
        model, which a script may split among optimizers) with its ``groups`` applied, its plan, and the
        process set it runs on. ``ValueError`` if the strategy names a variable that no optimizer of this
        process holds (checked by the first ``step()`` when planned before it)."""
        if self._all_built:
            self._check_held(strategy)
        if strategy is not None:
            strategy = strategy.restricted_to(name for name, _ in self._named)
        if self._groups is not None:
            strategy = strategy_with_groups(strategy, self._groups)
        plan = build_plan(variables_from_parameters(self._named), strategy,
                          compression=compression_name(self._compression))
        process_set = check_process_set(self._hvd, self._process_set_option, plan)
        if process_set.included() and (self._hvd.size() > 1 or self._elastic):  # it synchronizes
            _refuse_complex_on_the_ring(plan, self._params)
        return strategy, plan, process_set

    def _check_held(self, strategy: Strategy | None) -> None:
        """``ValueError`` naming the variables ``strategy`` names that neither this optimizer nor another
        live one of this process holds, nor will hold once ``add_param_group`` adds the parameters its
        ``named_parameters`` named (a misspelt name, a strategy for another model or another wrapper), as
        ``Strategy.validate_for`` names them; another name of a tied parameter is told the name to use.
        Optimizers already gone (an earlier model's) count for nothing."""
        if strategy is None:
            return
        known, aliases = _known_names([self])
        if not _held_errors(strategy, known, aliases):
            return  # the common case: one optimizer holds the whole model; no garbage collection
        errors = _held_errors(strategy, *_known_names([self, *_live_optimizers()]))
        if errors:
            raise ValueError("strategy does not fit the model:\n  - " + "\n  - ".join(errors))

    def set_strategy(self, strategy: Strategy | Mapping[str, Any] | str | os.PathLike | None) -> None:
        """Route gradients by ``strategy`` from the next step on (``None``: ``HYBRIDSYNC_STRATEGY``,
        else every variable ring all-reduced, as at construction; ``groups`` still apply).

        Collective: every rank calls it between steps (after ``step()`` or ``synchronize()``,
        before the next backward pass) with the same strategy. The ranks compare fingerprints
        first, so a rank that disagrees is a ``ValueError`` on every rank, and the current plan
        stays in force. The new plan runs under new names (PS keys, shared-memory segments),
        so nothing keyed by message name is reused with another shape; the old plan's keys,
        segments and groups are released once the new plan is ready. ASP/SSP variables join
        the servers at the next ``step()`` with their current values.
        """
        resolved = resolve_strategy(strategy)
        running = self.replace_plan(resolved)
        self._requested_strategy = resolved
        if self._sync_controller is not None:
            self._sync_controller.restore_hyperparameters()  # a policy that left them scaled for ASP
        self._use_controller(self._controller_for(running))

    # --- what hybridsync's own packages use: step hooks, the TensorFlow front end, experiments ---------
    def replace_plan(self, strategy: Strategy | None) -> Strategy | None:
        """Route by ``strategy`` (already resolved) from the next step on, as ``set_strategy`` does,
        but keep every step hook: the Sync-Switch controller switches protocols with it. Collective,
        between steps; ``ValueError`` (the current plan stays) when the ranks disagree. Returns the
        strategy it runs (in an elastic job, fitted to the world), before ``groups``."""
        if (self._router is not None and self._router.pending) or self._fired:
            raise ValueError("set_strategy() was called while gradients of this step are in flight (after "
                             "loss.backward(), before optimizer.step() or optimizer.synchronize()); call it "
                             "between steps, on every rank")
        current = self._router or self._built_router()
        if self._elastic:
            strategy = self._fitted_to_world(strategy)
        resolved, plan, process_set = self._plan_for(strategy)
        instance = None
        if self._synchronizing and process_set.size() > 1:
            # Before building anything: the new router's construction may be collective (hierarchical
            # groups, joining the servers), and a rank building another plan would leave the rest waiting.
            instance = self._check_ranks_agree(resolved, plan, process_set,
                                               next_instance() if self._elastic else current.instance,
                                               switching=True)
        router = Router(plan, self._params, compression=self._compression, reduction=self._reduction,
                        process_set=process_set, sparse_as_dense=self.sparse_as_dense, kinds=self._kinds,
                        instance=instance if self._elastic else None, scoped_names=self._elastic)
        previous, self._router = current, router  # the hooks read self._router at every gradient
        self.plan, self.strategy, self.process_set = plan, resolved, process_set
        previous.close()
        return strategy

    def rebuild_for_world(self) -> None:
        """Re-plan for the ranks Horovod will run at the next step: after an elastic reset
        (``hvd.shutdown(); hvd.init()`` re-formed the job because a worker was lost or added).

        ``hs.elastic.TorchState`` calls it at every reset; with Horovod's own ``TorchState``,
        register it: ``state.register_reset_callbacks([opt.rebuild_for_world])``. Here and now
        it only drops the step in flight and the current plan, without a word to the other
        ranks (some are gone), so it cannot fail. At the next step (its first gradient, or
        ``synchronize()``) the strategy this optimizer was given (or last ``set_strategy``) is
        fitted to the world, a route the world cannot run falling back to ring all-reduce with
        a warning naming the variables and why (``hybridsync.world``); the ranks check that they
        agree on the plan, and its groups are built: collectives, which belong inside
        ``hvd.elastic.run``'s step, where a worker lost meanwhile is recoverable and where a
        worker that joined builds its plan too. Parameters and optimizer state are left alone:
        the elastic state's ``sync()`` makes them identical on every rank.
        """
        self._drop_router()
        self._use_controller(None)
        self._kinds = GradientKinds()  # a worker that joined has agreed on none: every rank agrees anew
        self._fired.clear()
        self._allreduce_delay = {p: self.backward_passes_per_step for p in self._params}
        self._synchronized = False

    def _drop_router(self) -> None:
        """Abandon the current plan (``Router.abandon``) and the world's shared groups; the next step rebuilds."""
        if self._router is not None:
            self._router.abandon()
            self._router = None
        forget_world()

    def _built_router(self) -> Router:
        """The router, built first if there is none: the requested strategy fitted to the running
        world, the ranks' agreement on its plan (a worker that joined an elastic job has built fewer
        routers than the others, so they take the largest next number), then its groups.
        Collective: every rank reaches it at the same point, first thing in a step."""
        if self._router is not None:
            return self._router
        self._check_elastic_process_set()
        running = self._fitted_to_world(self._requested_strategy)
        self.strategy, self.plan, self.process_set = self._plan_for(running)
        self._synchronizing = self.process_set.included() and (self._hvd.size() > 1 or self._elastic)
        instance = (self._check_ranks_agree(self.strategy, self.plan, self.process_set, next_instance())
                    if self._synchronizing else None)
        self._router = Router(self.plan, self._params, compression=self._compression, reduction=self._reduction,
                              process_set=self.process_set, sparse_as_dense=self.sparse_as_dense, kinds=self._kinds,
                              instance=instance, scoped_names=self._elastic)
        self._use_controller(self._controller_for(running))
        return self._router

    def _fail_step(self, error: RuntimeError) -> None:
        """In an elastic job a collective of this step failed (a worker died): drop the plan now, so
        that peers waiting on this rank in its groups fail too instead of waiting while this rank
        re-forms the job, and raise ``HorovodInternalError``, the one error ``hvd.elastic.run``
        recovers from (the other routes' failures are given that type)."""
        self._drop_router()
        if isinstance(error, self._hvd.HorovodInternalError):
            raise error
        raise self._hvd.HorovodInternalError(f"hybridsync: a collective of this step failed: {error}") from error

    def _check_elastic_process_set(self) -> None:
        if self._elastic and self._process_set_option not in (None, self._hvd.global_process_set):
            raise ValueError(f"process_set={self._process_set_option} cannot be used in an elastic job: its "
                             f"ranks do not survive the job being re-formed; use the global process set")

    def _fitted_to_world(self, strategy: Strategy | None) -> Strategy | None:
        """``strategy`` with the routes the running world cannot run replaced (``hybridsync.world``);
        rank 0 warns of each fallback."""
        world = current_world()
        fitted, notes = fit_to_world(strategy, [name for name, _ in self._named], world)
        if notes and self._hvd.rank() == 0:
            warnings.warn(f"hybridsync: the strategy does not fit this world ({world}); falling back: "
                          + "; ".join(notes), RuntimeWarning, stacklevel=3)
        return fitted

    def _warn_of_dense_sparse_gradients(self) -> None:
        """Rank 0 warns, after the first step, of the sparse gradients the strategy sends at their full
        dense size (partitioned, merged or hierarchical on the all-reduce route): correct, but an
        embedding table's gradient can then cost many times the rows a step touched, with nothing
        else in the job's output to say why it is slow (``hybridsync explain`` says it ahead)."""
        router = self._router
        if router is None or not router.sent_dense or self._hvd.rank() != 0:
            return
        dense = sorted(router.sent_dense)
        names = ", ".join(f"{self.plan.var_names[i]} ({_megabytes(self._params[i])})" for i in dense[:5])
        more = f" and {len(dense) - 5} more" if len(dense) > 5 else ""
        warnings.warn(f"hybridsync: the strategy sends {len(dense)} sparse gradient(s) dense, at full size, every "
                      f"step: {names}{more}. Only a whole variable alone in its message on the ring, or any "
                      f"shape on the parameter server, travels as the rows a step touched.",
                      RuntimeWarning, stacklevel=3)

    def pull_parameters(self) -> None:
        """The ASP/SSP variables take the servers' current values, pushing nothing (the others are
        untouched). Called on every rank once every rank's last update is pushed (after a barrier),
        it leaves every rank with the same parameters."""
        self._router.pull_parameters()

    @property
    def plan_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the plan routes, in its order: ``plan.var_names[i]`` names the i-th."""
        return list(self._params)

    def close(self) -> None:
        """Release what the current plan holds beyond a step (PS keys, shared-memory segments, its share
        of the hierarchical groups). Collective, after the last step: the optimizer syncs no more."""
        self._router.close()

    def _check_ranks_agree(self, strategy: Strategy | None, plan: RoutingPlan, process_set: Any, instance: int,
                           switching: bool = False) -> int:
        """Every rank (of the process set) must route identically, freeze the same parameters and
        pass the same arguments; a difference fails on all of them now (``hybridsync.agreement``)
        instead of hanging later. ``instance`` is the router built last (``set_strategy``: the
        one being replaced), whose number names PS keys: ranks must agree on it too, except in an
        elastic job, where it is this process's next free number (a worker that joined has built
        fewer routers) and the largest serves every rank. Returns the number they agree on."""
        facts = RankFacts(strategy=(strategy or Strategy()).fingerprint(), plan=plan.fingerprint(), instance=instance,
                          frozen=tuple(name for name, p in self._named if not p.requires_grad),
                          settings={"backward_passes_per_step": self.backward_passes_per_step,
                                    "op": self._reduction.op, "prescale_factor": self._reduction.prescale_factor,
                                    "postscale_factor": self._reduction.postscale_factor,
                                    "sparse_as_dense": bool(self.sparse_as_dense),
                                    "compression": getattr(self._compression, "__name__",
                                                           type(self._compression).__name__)})
        return check_ranks_agree(self._hvd, facts, process_set, switching=switching, elastic=self._elastic)

    def load_state_dict(self, *args, **kwargs):
        self._fired.clear()
        self._allreduce_delay = {p: self.backward_passes_per_step for p in self._params}
        super(self.__class__, self).load_state_dict(*args, **kwargs)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated locally before synchronizing."""
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``; after construction, the group's parameters are synchronized too.

        Horovod's optimizer never synchronizes them (its ranks drift apart, with no word). Here the plan
        is rebuilt over them, as ``set_strategy`` rebuilds it with the strategy given: collective, every
        rank adds the same group between steps. A parameter is named as ``named_parameters`` named it
        (pass the whole model's to name the ones added later), else ``allreduce.noname.<group>.<i>``.
        """
        if "_named" not in self.__dict__:  # torch's __init__ adding the groups the optimizer is built with
            return super(self.__class__, self).add_param_group(param_group)
        if (self._router is not None and self._router.pending) or self._fired:
            raise ValueError("add_param_group() was called while gradients of this step are in flight (after "
                             "loss.backward(), before optimizer.step() or optimizer.synchronize()); call it "
                             "between steps, on every rank")
        super(self.__class__, self).add_param_group(param_group)
        group = len(self.param_groups) - 1
        new = [(self._spare_names.get(id(p), _unnamed(group, j)), p)
               for j, p in enumerate(self.param_groups[group]["params"])]
        self._named = self._named + new
        self._parameter_names.update((p, name) for name, p in new)
        for _, p in new:
            self._index[p] = len(self._params)
            self._params.append(p)
            self._allreduce_delay[p] = self.backward_passes_per_step
        if self._router is not None:
            self.replace_plan(self._requested_strategy)
        if self._synchronizing:
            self._register_hooks([p for _, p in new])

    def _register_hooks(self, params: Iterable[torch.nn.Parameter] | None = None) -> None:
        """A gradient hook on each of ``params`` that requires a gradient (by default: every parameter)."""
        for p in self._params if params is None else params:
            if p.requires_grad:
                # A newer optimizer over a parameter (a new training phase, one re-created after a
                # checkpoint) takes its gradient over: the older one's hook, which lives as long as
                # the parameter, would otherwise keep submitting it under the old plan.
                previous = getattr(p, "_hybridsync_hook", None)
                if previous is not None:
                    previous.remove()
                p._hybridsync_hook = p.register_post_accumulate_grad_hook(self._make_hook(p))
                self._grad_accs.append(p._hybridsync_hook)

    def _make_hook(self, p):
        # Runs for every parameter of every step, inside the backward pass: two lookups keyed by
        # the parameter (each a call of Tensor.__hash__), the rest by its index. A delay at 0 or
        # below means the parameter fired already (only this hook lowers it; every reset sets it
        # back to backward_passes_per_step). The hook lives as long as the parameter, in torch's
        # C++ autograd state, where the garbage collector cannot see it: it holds the optimizer
        # weakly and takes the parameter as its argument, or the two would keep each other alive
        # for the life of the process (an earlier model's optimizer, in a notebook or a sweep).
        index = self._index[p]
        optimizer = weakref.ref(self)

        def hook(param):
            self = optimizer()
            if self is None:
                return  # the optimizer is gone: nothing synchronizes this parameter any more
            delays = self._allreduce_delay
            delay = delays[param]
            if delay <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call "
                    "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
            assert not param.grad.requires_grad
            delays[param] = delay - 1
            self._fired.add(index)
            if delay == 1:
                try:
                    (self._router or self._built_router()).mark_ready(index)
                except RuntimeError as e:
                    if not self._elastic:
                        raise
                    self._fail_step(e)
        return hook

    def synchronize(self) -> None:
        """Finish every gradient's synchronization of this step and write the results into ``p.grad``."""
        if not self._synchronizing:
            self._synchronized = True
            return
        for hook in self._hooks:
            hook.before_sync()
        try:
            (self._router or self._built_router()).finish()
        except RuntimeError as e:  # Horovod's errors, Gloo's, a node peer gone, a parameter server gone
            if not self._elastic:
                raise
            self._fail_step(e)
        finally:
            self._fired.clear()
            # dict.fromkeys over a dict reuses its keys' hashes: no Tensor.__hash__ call per parameter.
            self._allreduce_delay = dict.fromkeys(self._allreduce_delay, self.backward_passes_per_step)
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use after a manual ``synchronize()`` (e.g. for gradient clipping) so ``step()`` does not repeat it."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if called_from_horovod_state_init():
            return wrapped_step(self, closure)  # see called_from_horovod_state_init
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        if not self._all_built:
            self._all_built = True
            self._check_held(self._requested_strategy)
            self._warn_of_dense_sparse_gradients()
        self._synchronized = False
        (self._router or self._built_router()).before_step()
        for hook in self._hooks:
            hook.before_step()
        result = super(self.__class__, self).step(closure)
        self._router.after_step()  # ASP/SSP variables: push the local update, adopt the servers' values
        finished = False
        for hook in self._hooks:  # each sees the step end, even after one ended the run
            finished = hook.after_step() or finished
        if finished:
            self.run_finished = True
            if self._ends_run:
                end_run()
        return result

    def zero_grad(self, set_to_none: bool = True):  # torch's default, which Horovod's zero_grad() gets
        if (self._router is not None and self._router.pending) or self._fired:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it "
                                 "can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none)


_LIVE_OPTIMIZERS: weakref.WeakSet = weakref.WeakSet()
"""Every DistributedOptimizer of this process still alive: a strategy names the whole model's variables,
which a script may split among optimizers (a GAN's generator and discriminator, a sparse and a dense
one), and each optimizer routes its own part. Weak, so that an optimizer of an earlier model (a notebook
cell, a sweep's last run, an earlier test) lends its names to no later check once it is gone."""

_built_since_collect = False
"""An optimizer was built since ``_live_optimizers`` last collected garbage."""


def _register_live(optimizer: "_DistributedOptimizer") -> None:
    global _built_since_collect
    _LIVE_OPTIMIZERS.add(optimizer)
    _built_since_collect = True


def _live_optimizers() -> list["_DistributedOptimizer"]:
    """The DistributedOptimizers of this process still alive. An optimizer and its parameters hold each
    other (their gradient hooks call it), so one the script dropped lives on until the garbage collector
    runs: it is run once after optimizers were built (0.4 s with torch and Horovod loaded, 2 cores), only
    by a check that needs another optimizer's names, never at every plan."""
    global _built_since_collect
    if _built_since_collect:
        _built_since_collect = False
        gc.collect()
    return list(_LIVE_OPTIMIZERS)


def _megabytes(param: torch.Tensor) -> str:
    return f"{param.numel() * param.element_size() / 1e6:.1f} MB"


def _known_names(optimizers: Iterable["_DistributedOptimizer"]) -> tuple[set[str], dict[str, str]]:
    """The variable names ``optimizers`` hold, or will once ``add_param_group`` adds the parameters their
    ``named_parameters`` named (a fine-tuning script's later head); and their tied parameters' aliases."""
    known: set[str] = set()
    aliases: dict[str, str] = {}
    for optimizer in optimizers:
        known.update(name for name, _ in optimizer._named)
        known.update(optimizer._spare_names.values())
        known.update(optimizer._known_elsewhere)
        aliases.update(optimizer._aliases)
    return known, aliases


def _held_errors(strategy: Strategy, known: set[str], aliases: Mapping[str, str]) -> list[str]:
    """The strategy's variables outside ``known`` (``unknown_variable_errors``), and the tied aliases it
    names, each told the name to use."""
    named_aliases = [name for name in strategy.variables if name in aliases]
    errors = [f"variable {name!r} is the same parameter as {aliases[name]!r} (tied weights are one "
              f"variable, under their first name): configure it as {aliases[name]!r}" for name in sorted(named_aliases)]
    return errors + unknown_variable_errors((name for name in strategy.variables if name not in aliases), known)


def _refuse_complex_on_the_ring(plan: RoutingPlan, params: list[torch.nn.Parameter]) -> None:
    """``ValueError`` naming the trainable complex parameters (an FFT layer's) that ``plan`` sends by
    Horovod's ring all-reduce, which refuses complex tensors (``Tensor type torch.ComplexFloatTensor is
    not supported``, from inside the first backward pass, naming none). The hierarchical route and the
    parameter server sum them (torch's Gloo and the servers add complex tensors); a frozen one sends
    nothing, as under Horovod, whose optimizer works with one only while it gets no gradient."""
    ring = {piece.var_index for message in plan.messages
            if message.config.route == "allreduce" and message.config.algorithm == "ring" for piece in message.pieces}
    refused = [f"{plan.var_names[i]!r} ({str(params[i].dtype).removeprefix('torch.')})" for i in sorted(ring)
               if params[i].is_complex() and params[i].requires_grad]
    if refused:
        listed = ", ".join(refused)
        raise ValueError(f"complex parameters cannot be ring all-reduced (Horovod refuses complex tensors): {listed}; "
                         f"route them \"algorithm\": \"hierarchical\" or \"route\": \"ps\" in the strategy (both sum "
                         f"complex gradients), or hold them as real tensors (torch.view_as_real)")


def _checked_named_parameters(named_parameters: Iterable | None, param_groups
                              ) -> tuple[list[tuple[str, Any]], dict[str, str], list[tuple[str, Any]]]:
    """Horovod's naming rules: unique names, every optimized parameter named, defaults otherwise; the
    names dropped as another name of a parameter already named, each to the name kept; and the named
    parameters the optimizer does not hold (yet: ``add_param_group``), each under its first name.

    A parameter listed under several names (tied weights, from ``named_parameters(remove_duplicate=False)``
    or two submodules' lists joined) is one variable, under its first name as ``model.named_parameters()``
    gives it: Horovod synchronizes it once too, where two variables would reduce its gradient twice."""
    if named_parameters is None:
        return [(_unnamed(i, j), p) for i, group in enumerate(param_groups)
                for j, p in enumerate(group["params"])], {}, []
    named = list(named_parameters)
    if any(not (isinstance(item, tuple) and len(item) == 2) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually "
                         "produced by model.named_parameters().")
    names = [name for name, _ in named]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                         f"{', '.join(duplicates)}")
    named_set = {id(p) for _, p in named}
    unnamed = [p for group in param_groups for p in group["params"] if id(p) not in named_set]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but one or more model parameters were not "
                         f"named. Python object ids: {', '.join(str(id(p)) for p in unnamed)}")
    optimized = {id(p) for group in param_groups for p in group["params"]}
    unique: dict[int, tuple[str, Any]] = {}
    aliases: dict[str, str] = {}
    spare: dict[int, tuple[str, Any]] = {}
    for name, p in named:
        if id(p) in optimized:
            kept = unique.setdefault(id(p), (name, p))[0]
            if kept != name:
                aliases[name] = kept
        else:
            spare.setdefault(id(p), (name, p))
    return list(unique.values()), aliases, list(spare.values())


def _unnamed(group: int, position: int) -> str:
    """Horovod's name for the ``position``-th parameter of param group ``group`` when none was given."""
    return f"allreduce.noname.{group}.{position}"


def _check_not_wrapped(optimizer: torch.optim.Optimizer) -> None:
    """``ValueError`` for an optimizer that synchronizes already (hybridsync's or Horovod's, as a script
    half migrated from ``hvd`` has it): wrapped again, its class's ``__init__`` would be called without
    the arguments it needs (Horovod's own double wrap fails alike, with a ``TypeError`` naming none)."""
    if hasattr(optimizer, "skip_synchronize"):
        owner = "hybridsync's" if getattr(optimizer, "_is_hybridsync", False) else "horovod.torch's"
        raise ValueError(f"optimizer is a DistributedOptimizer already ({owner}): wrap the plain torch "
                         f"optimizer once, with hs.DistributedOptimizer only")


def _reduction(op: int, gradient_predivide_factor: float) -> Reduction:
    if op == Average:
        # Horovod splits the average: 1/f before the sum, f/size after it.
        return Reduction(op="average", prescale_factor=1.0 / gradient_predivide_factor,
                         postscale_factor=gradient_predivide_factor)
    return Reduction(op="sum")


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable | None = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: int | list | None = None, sparse_as_dense: bool = False,
                         process_set: Any = None,
                         strategy: Strategy | Mapping[str, Any] | str | os.PathLike | None = None
                         ) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so gradients are synchronized across ranks before ``step()``.

    Same arguments and semantics as ``horovod.torch.DistributedOptimizer`` (v0.28.1), plus
    ``strategy``: a ``Strategy``, a strategy dict, or a path to a JSON/YAML file. When
    ``None``, the path in ``HYBRIDSYNC_STRATEGY`` is used; with neither, every variable
    is ring all-reduced under its own name, exactly as Horovod does.

    ``groups`` (or the deprecated ``num_groups``) become merge groups of the routing plan;
    a variable cannot be in one of them and in a strategy group as well. ``sparse_as_dense``
    all-reduces sparse gradients as dense tensors (sparse again before ``step()``).
    ``process_set`` (``None``: every rank) synchronizes among its ranks only, by ring
    all-reduce; ranks outside it step on their local gradients.
    """
    options = SyncOptions.checked(compression=compression, backward_passes_per_step=backward_passes_per_step, op=op,
                                  gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
                                  groups=groups, sparse_as_dense=sparse_as_dense, process_set=process_set,
                                  strategy=strategy)
    return wrap(optimizer, named_parameters, options)


def wrap(optimizer: torch.optim.Optimizer, named_parameters: Iterable | None, options: SyncOptions,
         frontend: Literal["torch", "tensorflow"] = "torch", known_elsewhere: Iterable[str] = ()
         ) -> torch.optim.Optimizer:
    """``DistributedOptimizer`` of ``options`` (``SyncOptions.checked``) for a given ``frontend``:
    ``tensorflow`` when ``hybridsync.tensorflow`` drives it over torch mirrors of a TensorFlow model's
    variables (whose ``groups`` lists, of mirrors, are checked here). ``known_elsewhere``: names of
    the script's variables that another optimizer holds or will hold (a tape's watched variables that
    another tape synchronizes: a GAN's, whose second tape is built after the first one's check)."""
    _check_not_wrapped(optimizer)
    options = dataclasses.replace(options, groups=normalize_groups(options.groups, 0))
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, options, frontend, known_elsewhere)
