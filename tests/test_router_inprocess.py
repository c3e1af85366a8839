"""The router against in-process backends that compute true sums: no Horovod, no job launch.

``SIZE`` simulated ranks run in threads of this process, each with its own model copy and
``Router``. Their transports meet in ``KeyStore``s, the parameter server's own store:

- ring: a ``SparseBackend`` (dense messages and whole sparse gradients);
- hierarchical: a plain ``Backend`` (so the router must make sparse gradients dense);
- parameter server: the real ``PSBackend``, ``PSClient`` (placement, chunking, prescale,
  scatter, sparse parts) and ``AsyncParameterSync``, with only the RPC replaced by a call
  into a ``KeyStore`` per server.

Every synchronized gradient must equal the reduction computed directly from each rank's
local gradients (partitions, merge groups, fp16, sparse, parameters without a gradient on
some or all ranks), and every key a client pushed must be where ``RoutingPlan.ps_keys``
(torch-free) predicted, with the bytes it predicted.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.nn as nn
from torch.futures import Future

from hybridsync.backends import KeyedBackend, Reduction, SparseBackend, StagedBackend, stalls
from hybridsync.backends.ps import route
from hybridsync.backends.ps.client import PSBackend, PSClient
from hybridsync.backends.ps.config import PSConfig
from hybridsync.backends.ps.store import KeyStore
from hybridsync.compression import Compression
from hybridsync.router.plan import RoutingPlan, build_plan
from hybridsync.router.runtime import Router
from hybridsync.strategy import Strategy
from hybridsync.variables import variables_from_model

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

SIZE = 3
NUM_SERVERS = 2
PARTITION_BYTES = 96  # small keys: most PS messages are cut into several
STEPS = 2


class Net(nn.Module):
    """An embedding, two layers, a layer only rank 0 uses and one nobody uses."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 6, sparse=sparse)
        self.fc1 = nn.Linear(6, 20)
        self.fc2 = nn.Linear(20, 3)
        self.rank0_only = nn.Linear(3, 3)
        self.unused = nn.Linear(2, 2)

    def forward(self, ids: torch.Tensor, rank: int) -> torch.Tensor:
        out = self.fc2(torch.relu(self.fc1(self.emb(ids).mean(dim=1))))
        return out + self.rank0_only(out) if rank == 0 else out


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randint(0, 30, (4, 5), generator=gen), torch.randn(4, 3, generator=gen)


def backward(model: Net, rank: int, step: int) -> None:
    ids, target = batch(rank, step)
    nn.functional.mse_loss(model(ids, rank), target).backward()


# ------------------------------------------------------------------ in-process transports
class _Handle:
    def __init__(self, wait: Callable[[], None]) -> None:
        self.wait = wait


class StoreAllreduce:
    """All-reduce through a shared ``KeyStore``: each tensor of a message is one key."""

    def __init__(self, store: KeyStore, rank: int) -> None:
        self.store, self.rank = store, rank
        self._steps: dict[str, int] = {}

    def push(self, key: str, payload: Any) -> Future:
        step = self._steps.get(key, 0)
        self._steps[key] = step + 1
        return self.store.push_pull(key, self.rank, step, payload)

    def submit(self, name: str, tensors: Sequence[torch.Tensor], reduction: Reduction) -> _Handle:
        futures = [self.push(f"{name}#{i}", t * reduction.prescale_factor) for i, t in enumerate(tensors)]

        def wait() -> None:
            for tensor, future in zip(tensors, futures):
                tensor.copy_(future.wait() * reduction.result_factor(SIZE))
        return _Handle(wait)

    def close(self) -> None:
        """Nothing outlives a step here."""


class SparseStoreAllreduce(StoreAllreduce, SparseBackend):
    """As the ring backend: whole sparse gradients travel sparse."""

    def submit_sparse(self, name: str, grad: torch.Tensor, reduction: Reduction) -> Callable[[], torch.Tensor]:
        grad = grad.coalesce()
        future = self.push(name, (grad.indices(), grad.values() * reduction.prescale_factor, tuple(grad.shape)))

        def result() -> torch.Tensor:
            indices, values, size = future.wait()
            return torch.sparse_coo_tensor(indices, values * reduction.result_factor(SIZE), size,
                                           check_invariants=False)
        return result


class InProcessClient(PSClient):
    """The real PS client with the network replaced: a call goes straight into a server's ``KeyStore``."""

    def __init__(self, config: PSConfig, stores: list[KeyStore]) -> None:
        self.stores = stores
        self.calls: list[tuple[int, str, str, Any]] = []
        """``(server, function, key, payload)`` of every call, in order."""
        self._lock = threading.Lock()
        super().__init__(config)

    def _connect(self, *timeouts: float) -> None:
        pass

    def transport(self, index: int, function: str, args: tuple, *, timeout: float = 0) -> Future:
        store = self.stores[index]
        if function == "rpc_init_async":
            key, _, value, staleness = args
            with self._lock:
                self.calls.append((index, function, key, value))
            done: Future = Future()
            done.set_result(store.init_async(key, value, staleness))
            return done
        key, worker, step, payload = args
        with self._lock:
            self.calls.append((index, function, key, payload))
        method = store.push_delta if function == "rpc_push_delta" else store.push_pull
        return _answered_elsewhere(method(key, worker, step, payload))


_ANSWERS = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="answers")
"""Where the stores' answers reach the clients, as RPC answers reach them on the agent's threads: the
last rank's push completes the other ranks' futures, and their callbacks take those clients' locks,
which a client calling in at the same moment holds (two ranks would wait on each other)."""


def _answered_elsewhere(answer: Future) -> Future:
    out: Future = Future()

    def forward(done: Future) -> None:
        try:
            out.set_result(done.value())
        except Exception as e:  # noqa: BLE001 - handed to the client, as an RPC error would be
            out.set_exception(e)
    answer.add_done_callback(lambda done: _ANSWERS.submit(forward, done))
    return out


class InProcessExchange:
    """The ranks' all-gather of their gradient kinds (``Router``'s ``exchange``), through a barrier."""

    def __init__(self) -> None:
        self.rounds: list[tuple[str, list[list[int]]]] = []
        """``(name, every rank's states)`` of each exchange, in order."""
        self._barrier = threading.Barrier(SIZE, timeout=30)
        self._states: list[list[int] | None] = [None] * SIZE

    def for_rank(self, rank: int) -> Callable[[list[int], str], list[list[int]]]:
        def exchange(states: list[int], name: str) -> list[list[int]]:
            self._states[rank] = list(states)
            self._barrier.wait()
            everyone = [list(s) for s in self._states]  # type: ignore[arg-type]
            if rank == 0:
                self.rounds.append((name, everyone))
            self._barrier.wait()  # nobody overwrites its states before every rank has read them
            return everyone
        return exchange


class World:
    """The ranks' shared transports: an all-reduce store and one store per parameter server."""

    def __init__(self) -> None:
        self.exchange = InProcessExchange()
        self.allreduce = KeyStore(num_workers=SIZE)
        self.servers = [KeyStore(num_workers=SIZE) for _ in range(NUM_SERVERS)]
        self.clients = [InProcessClient(PSConfig(role="worker", num_workers=SIZE, num_servers=NUM_SERVERS,
                                                 root_uri="in-process", root_port=1, index=rank,
                                                 partition_bytes=PARTITION_BYTES), self.servers)
                        for rank in range(SIZE)]

    def router(self, rank: int, plan: RoutingPlan, model: Net, reduction: Reduction, compression: Any,
               instance: int, sparse_as_dense: bool = False) -> Router:
        """Rank ``rank``'s router; ``instance`` numbers it as the ranks' ``Router`` counters would in a job."""
        client = self.clients[rank]

        def backends(route_name: str, variant: str, variables: Sequence[str] = (), namespace: str = "",
                     process_set: Any = None) -> Any:
            if (route_name, variant) == ("allreduce", "ring"):
                return SparseStoreAllreduce(self.allreduce, rank)
            if (route_name, variant) == ("allreduce", "hierarchical"):
                return StoreAllreduce(self.allreduce, rank)
            return route.bsp_backend(namespace, client=client)

        def parameter_syncs(pieces, staleness, namespace=""):
            return route.parameter_sync(pieces, staleness, namespace, client=client)

        return Router(plan, list(model.parameters()), compression=compression, reduction=reduction,
                      backends=backends, parameter_syncs=parameter_syncs, exchange=self.exchange.for_rank(rank),
                      instance=instance, sparse_as_dense=sparse_as_dense)


def run_ranks(work: Callable[[int], Any]) -> list[Any]:
    """``work(rank)`` for every rank, each in its own thread; the first error fails the test (never hangs)."""
    results: list[Any] = [None] * SIZE
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(SIZE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads), "a simulated rank is stuck (a message never completed)"
    return results


# ------------------------------------------------------------------ scenarios
def strategy(default: dict, variables: dict | None = None) -> Strategy:
    return Strategy.from_dict({"version": 1, "default": default, "variables": variables or {}})


RING, HIER, PS = {"route": "allreduce"}, {"route": "allreduce", "algorithm": "hierarchical"}, {"route": "ps"}
STRATEGIES = {
    "default": None,
    "ring_partitions_groups_fp16": strategy(RING, {
        "fc1.weight": {**RING, "partitions": 3, "group": 1, "compression": "fp16"},
        "fc1.bias": {**RING, "group": 1, "compression": "fp16"},
        "emb.weight": {**RING, "partitions": 2, "group": 2},  # a sparse member of a group: made dense
        "rank0_only.weight": {**RING, "group": 2}, "unused.weight": {**RING, "group": 2},
        "fc2.weight": {**RING, "partitions": 2}}),
    "hierarchical": strategy(HIER, {"fc1.weight": {**HIER, "partitions": 2}, "fc2.bias": {**HIER, "group": 0},
                                    "rank0_only.bias": {**HIER, "group": 0}}),
    "ps_whole": strategy(PS),
    "ps_partitions_groups_servers_fp16": strategy(RING, {
        "emb.weight": {**PS, "partitions": 2, "group": 4},
        "fc1.bias": {**PS, "group": 4}, "unused.bias": {**PS, "group": 4},
        "fc1.weight": {**PS, "partitions": 3, "servers": [1, 0, 1], "compression": "fp16"},
        "fc2.weight": {**PS, "group": 5}, "fc2.bias": {**PS, "group": 5},
        "rank0_only.weight": {**PS, "partitions": 3}}),
    "mixed_routes": strategy(PS, {"emb.weight": RING, "fc1.weight": {**HIER, "partitions": 2},
                                  "fc2.weight": {**RING, "group": 1}, "fc2.bias": {**RING, "group": 1}}),
}
ROWS = {"rows": True}
ROWS_STRATEGIES = {  # dense gradients sent as their nonzero rows (a dense model only)
    "rows_ring": strategy(RING, {"emb.weight": {**RING, **ROWS}, "fc1.weight": {**RING, **ROWS},
                                 "rank0_only.weight": {**RING, **ROWS}, "unused.weight": {**RING, **ROWS},
                                 "fc2.weight": {**HIER, "partitions": 2}}),
    "rows_ps": strategy(RING, {
        "emb.weight": {**PS, **ROWS, "partitions": 2, "group": 4}, "fc1.bias": {**PS, "group": 4},
        "unused.weight": {**PS, **ROWS, "group": 4}, "fc1.weight": {**PS, **ROWS, "partitions": 3},
        "fc2.weight": {**PS, **ROWS}, "rank0_only.weight": {**PS, **ROWS}, "fc2.bias": {**PS, "compression": "fp16"}}),
}
REDUCTIONS = {"average": Reduction(), "sum_scaled": Reduction(op="sum", prescale_factor=0.5, postscale_factor=3.0)}


def local_gradients(sparse: bool, step: int) -> list[list[torch.Tensor]]:
    """Each rank's own gradients (dense; zeros where it has none), computed directly."""
    out = []
    for rank in range(SIZE):
        torch.manual_seed(0)
        model = Net(sparse)
        backward(model, rank, step)
        out.append([p.grad.to_dense() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()])
    return out


def synchronized(name: str, sparse: bool, reduction: Reduction, compression: Any = None, *,
                 sparse_as_dense: bool = False):
    """Run ``STEPS`` steps on every simulated rank; returns (world, plan, routers, per rank per step grads)."""
    from hybridsync.compression import Compression
    compression = compression or Compression.none
    world = World()
    torch.manual_seed(0)
    models = [Net(sparse) for _ in range(SIZE)]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    plan = build_plan(variables_from_model(models[0]), {**STRATEGIES, **ROWS_STRATEGIES}[name],
                      compression="fp16" if compression is Compression.fp16 else "none")
    routers = [world.router(rank, plan, models[rank], reduction, compression, instance=7,
                            sparse_as_dense=sparse_as_dense) for rank in range(SIZE)]

    def work(rank: int) -> list[list[torch.Tensor]]:
        model, router, grads = models[rank], routers[rank], []
        for step in range(STEPS):
            model.zero_grad(set_to_none=True)
            backward(model, rank, step)
            for index, param in reversed(list(enumerate(model.parameters()))):
                if param.grad is not None:
                    router.mark_ready(index)
            router.finish()
            grads.append([p.grad.clone() for p in model.parameters()])
        return grads

    return world, plan, routers, run_ranks(work)


@pytest.mark.parametrize("reduction", sorted(REDUCTIONS))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_rank_gets_the_true_reduction(name, sparse, reduction):
    op = REDUCTIONS[reduction]
    world, plan, routers, results = synchronized(name, sparse, op)
    fp16 = any(m.config.compression == "fp16" for m in plan.messages)
    for step in range(STEPS):
        local = local_gradients(sparse, step)
        for index, var in enumerate(plan.var_names):
            expected = sum(g[index] for g in local) * op.prescale_factor * op.result_factor(SIZE)
            for rank in range(SIZE):
                got = results[rank][step][index]
                assert got.is_sparse == (sparse and var == "emb.weight"), (var, "the gradient's layout changed")
                tolerance = 2e-3 if fp16 else 1e-5
                assert torch.allclose(got.to_dense(), expected, atol=tolerance, rtol=tolerance), (var, rank, step)
    assert not any(router.pending for router in routers)


def test_fp16_optimizer_compression_is_what_the_plan_predicts():
    """The optimizer's ``compression=`` (no per-variable one): fp16 keys, half the bytes, true sums."""
    from hybridsync.compression import Compression
    world, plan, _, results = synchronized("ps_whole", False, Reduction(), Compression.fp16)
    assert all(t.dtype == "float16" for m in plan.messages for t in m.wire)
    local = local_gradients(False, STEPS - 1)
    for index, _ in enumerate(plan.var_names):
        expected = sum(g[index] for g in local) / SIZE
        assert torch.allclose(results[1][STEPS - 1][index], expected, atol=2e-3, rtol=2e-3)
    _assert_pushes_as_predicted(world, plan, "opt7")


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("name", ["ps_whole", "ps_partitions_groups_servers_fp16", "mixed_routes"])
def test_keys_and_servers_are_what_the_torch_free_plan_predicts(name, sparse):
    world, plan, routers, _ = synchronized(name, sparse, Reduction())
    assert {r.namespace for r in routers} == {"opt7"}
    _assert_pushes_as_predicted(world, plan, "opt7")


def _assert_pushes_as_predicted(world: World, plan: RoutingPlan, namespace: str) -> None:
    """Every key every client pushed went to the predicted server with the predicted bytes (touched rows
    within their bound), and every predicted key was pushed, ``STEPS`` times, but those of a message of
    ``unused`` variables only: no rank ever has a gradient for them, so their kind is never known (a
    first push would fix it) and their sum is the zeros every rank holds."""
    unused = {m.name for m in plan.messages if all(p.var_name.startswith("unused.") for p in m.pieces)}
    predicted = {key.name: key for name, keys in plan.ps_keys(num_servers=NUM_SERVERS, partition_bytes=PARTITION_BYTES,
                                                              namespace=namespace).items()
                 if name not in unused for key in keys}
    for client in world.clients:
        pushes: dict[str, int] = {}
        for server, function, key, payload in client.calls:
            assert key in predicted, f"{key} was pushed but not predicted (predicted: {sorted(predicted)})"
            assert server == predicted[key].server, (key, server, predicted[key])
            if predicted[key].sparse:
                indices, values, _ = payload
                assert values.nbytes <= predicted[key].nbytes and indices.shape[1] == values.shape[0]
            else:
                assert payload.nbytes == predicted[key].nbytes, (key, payload.nbytes, predicted[key])
            pushes[key] = pushes.get(key, 0) + 1
        assert pushes == {key: STEPS for key in predicted}, "a predicted key was never pushed, or pushed unevenly"
        declared = client.keys.loads
        assert sum(declared) == sum(m.wire_bytes for m in plan.messages if m.config.route == "ps"), declared


def test_asp_and_ssp_parameters_live_on_the_predicted_servers():
    """ASP/SSP pieces: the servers hold the first worker's value plus every worker's update."""
    plan_strategy = strategy(RING, {"fc1.weight": {**PS, "protocol": "asp", "partitions": 2},
                                    "fc2.weight": {**PS, "protocol": "ssp", "staleness": 1, "group": 3},
                                    "fc2.bias": {**PS, "protocol": "ssp", "staleness": 1, "group": 3},
                                    "emb.weight": {**PS, "partitions": 2, "servers": [1, 1]}})
    from hybridsync.compression import Compression
    world, lr = World(), 0.1
    torch.manual_seed(0)
    models = [Net(False) for _ in range(SIZE)]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    initial = [p.detach().clone() for p in models[0].parameters()]
    plan = build_plan(variables_from_model(models[0]), plan_strategy)
    routers = [world.router(rank, plan, models[rank], Reduction(), Compression.none, instance=3)
               for rank in range(SIZE)]
    stepped = threading.Barrier(SIZE, timeout=30)

    def work(rank: int) -> None:
        model, router = models[rank], routers[rank]
        backward(model, rank, 0)
        for index, param in enumerate(model.parameters()):
            if param.grad is not None:
                router.mark_ready(index)
        router.finish()
        router.before_step()
        with torch.no_grad():
            for param in model.parameters():
                param -= lr * param.grad
        router.after_step()
        stepped.wait()
        router.after_step()  # nothing new to push: every rank now pulls the servers' final values

    run_ranks(work)
    local = local_gradients(False, 0)
    asynchronous = {p.var_name for m in plan.messages if m.exchanges_parameters for p in m.pieces}
    for index, var in enumerate(plan.var_names):
        total = sum(g[index] for g in local)
        expected = initial[index] - lr * (total if var in asynchronous else total / SIZE)
        for rank in range(SIZE):
            got = list(models[rank].parameters())[index]
            assert torch.allclose(got, expected, atol=1e-5), (var, rank)
    _assert_async_as_predicted(world, plan, "opt3")


def _assert_async_as_predicted(world: World, plan: RoutingPlan, namespace: str) -> None:
    predicted = {key.name: key for keys in plan.ps_keys(num_servers=NUM_SERVERS, partition_bytes=PARTITION_BYTES,
                                                        namespace=namespace).values() for key in keys}
    for client in world.clients:
        created = {key: server for server, function, key, _ in client.calls if function == "rpc_init_async"}
        asynchronous = {k for m in plan.messages if m.exchanges_parameters
                        for k in (key.name for key in plan.ps_keys(num_servers=NUM_SERVERS,
                                                                    partition_bytes=PARTITION_BYTES,
                                                                    namespace=namespace)[m.name])}
        assert set(created) == asynchronous
        for key, server in created.items():
            assert predicted[key].server == server, key
        for server, _, key, payload in client.calls:
            assert predicted[key].server == server and payload.nbytes == predicted[key].nbytes, key


def test_capabilities_are_declared_not_probed():
    """The router asks each backend once what it supports; a plain backend gets dense tensors."""
    world = World()
    assert isinstance(SparseStoreAllreduce(world.allreduce, 0), SparseBackend)
    assert not isinstance(StoreAllreduce(world.allreduce, 0), SparseBackend)
    backend = PSBackend(world.clients[0])
    assert isinstance(backend, KeyedBackend) and isinstance(backend, SparseBackend)
    assert not isinstance(StoreAllreduce(world.allreduce, 0), KeyedBackend)


def test_message_wire_matches_what_the_router_sends():
    """``Message.wire`` (torch-free) against the compressed tensors the router hands its backend."""
    from hybridsync.compression import Compression
    for compression in (Compression.none, Compression.fp16):
        name = "ps_partitions_groups_servers_fp16"
        world, plan, _, _ = synchronized(name, False, Reduction(), compression)
        sent: dict[str, int] = {}
        for _, function, key, payload in world.clients[0].calls:
            if function == "rpc_push_pull":
                sent[key] = sent.get(key, 0) + payload.nbytes
        for message in plan.messages:
            if message.config.route == "ps":
                pushed = sum(n for k, n in sent.items() if k == f"opt7/{message.name}" or
                             k.startswith(f"opt7/{message.name}@"))
                assert pushed == STEPS * message.wire_bytes, (message.name, pushed, message.wire_bytes)
    assert dataclasses.is_dataclass(plan.messages[0])


class _RecordingBackend:
    """Reduces nothing; records the order in which its messages are waited for. ``any_order``: it
    declares ``waits_in_any_order``, as the ring's backend does."""

    def __init__(self, waited: list[str], any_order: bool = False) -> None:
        self.waited = waited
        if any_order:
            self.waits_in_any_order = True

    def submit(self, name: str, tensors: Sequence[torch.Tensor], reduction: Reduction) -> _Handle:
        return _Handle(lambda: self.waited.append(name))

    def close(self) -> None:
        """Nothing outlives a step here."""


@pytest.mark.parametrize("algorithm, ring_serves_it", [("ring", True), ("hierarchical", False),
                                                      ("hierarchical", True)])
def test_ring_waits_follow_submission_other_routes_the_plan(algorithm, ring_serves_it):
    """Horovod's ring handles complete on Horovod's thread: taken in the order they were submitted,
    as Horovod does; a route whose wait meets the other ranks in a collective (here one
    hierarchical variable, on a backend that is not staged) makes every wait of the step follow
    the plan, whatever order the gradients came in (staged backends: reverse plan order, below).
    A hierarchical variable that the ring's backend serves (one rank per node: ``make_backend``)
    is the ring's: before, the route's name alone put every wait of such a plan in plan order."""
    waited: list[str] = []
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    named = list(model.named_parameters())
    for _, param in named:
        param.grad = torch.ones_like(param)
    strategy = Strategy.from_dict({"version": 1, "variables": {"1.bias": {"route": "allreduce",
                                                                           "algorithm": algorithm}}})
    plan = build_plan(variables_from_model(model), strategy)
    router = Router(plan, [p for _, p in named], compression=Compression.none, reduction=Reduction(),
                    backends=lambda route, variant, **_: _RecordingBackend(waited, variant == "ring" or ring_serves_it))
    for var_index in range(len(named)):  # not the backward pass's order: rank-dependent orders happen
        router.mark_ready(var_index)
    router.finish()
    in_plan_order = [m.name for m in plan.messages]
    assert waited == in_plan_order
    waited.clear()
    for var_index in reversed(range(len(named))):
        router.mark_ready(var_index)
    router.finish()
    assert waited == (in_plan_order[::-1] if ring_serves_it else in_plan_order)


class _StagedHandle:
    """Starts in ``advance`` once its name is in ``can_start`` (its node's other ranks submitted
    too), else in ``wait``; records the order of starts and of waits."""

    def __init__(self, name: str, log: dict[str, list[str]], can_start: set[str]) -> None:
        self.name, self.log, self.can_start, self.started = name, log, can_start, False

    def advance(self) -> bool:
        if not self.started and self.name in self.can_start:
            self._start()
        return self.started

    def _start(self) -> None:
        self.log["started"].append(self.name)
        self.started = True

    def wait(self) -> None:
        if not self.started:
            self._start()
        self.log["waited"].append(self.name)


class _StagedRecorder(StagedBackend):
    def __init__(self, log: dict[str, list[str]], can_start: set[str]) -> None:
        self.log, self.can_start = log, can_start

    def submit(self, name: str, tensors: Sequence[torch.Tensor], reduction: Reduction) -> _StagedHandle:
        return _StagedHandle(name, self.log, self.can_start)

    def advance(self, handle: _StagedHandle) -> bool:
        return handle.advance()

    def close(self) -> None:
        """Nothing outlives a step here."""


def _three_hierarchical_layers() -> tuple[list[nn.Parameter], RoutingPlan, list[str]]:
    """Three linear layers with gradients, every variable its own hierarchical message; the names."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3), nn.Linear(3, 2))
    params = list(model.parameters())
    for param in params:
        param.grad = torch.ones_like(param)
    plan = build_plan(variables_from_model(model), Strategy.from_dict(
        {"version": 1, "default": {"route": "allreduce", "algorithm": "hierarchical"}}))
    return params, plan, [m.name for m in plan.messages]


def test_staged_messages_start_during_the_backward_pass_in_one_order():
    """Hierarchical messages start across nodes from the gradient hooks, not in ``finish()``, so that
    they travel while the backward pass goes on; every rank starts them in one order (the first
    step's, here reverse plan order), so a message whose node is not ready holds back the ones
    after it, never overtaken."""
    params, plan, names = _three_hierarchical_layers()
    order = names[::-1]
    log: dict[str, list[str]] = {"started": [], "waited": []}
    can_start = set(names)
    router = Router(plan, params, compression=Compression.none, reduction=Reduction(),
                    backends=lambda *_, **__: _StagedRecorder(log, can_start), exchange=_alone)

    def step(var_order: Sequence[int], before_finish: Callable[[int], list[str]]) -> None:
        for count, var_index in enumerate(var_order, 1):
            router.mark_ready(var_index)
            assert log["started"] == before_finish(count), f"after {count} gradients"
        router.finish()
        assert log["started"] == log["waited"] == order
        log["started"].clear()
        log["waited"].clear()

    backward = list(reversed(range(len(params))))
    step(backward, lambda count: order[:count])  # each starts at its own gradient's hook
    can_start.discard(order[0])  # the last layer's node peer is late: nothing overtakes it
    step(backward, lambda count: [])
    can_start.add(order[0])
    step(range(len(params)), lambda count: order if count == len(params) else [])  # gradients in forward order


def _alone(states: list[int], name: str) -> list[list[int]]:
    """A process set of one rank: an all-gather returns this rank's states."""
    return [states]


@pytest.mark.parametrize("first_rank_order", ["same", "other"])
def test_staged_messages_follow_the_first_steps_order_from_the_second_step_on(first_rank_order):
    """A model that declares its layers in another order than it uses them (here the gradients come
    in forward order): reverse plan order would hold every message back until the backward pass
    ends. After the first step every rank adopts the order the first rank submitted its messages
    in, for starts and waits; a rank whose own order differed takes the first rank's."""
    params, plan, names = _three_hierarchical_layers()
    first_rank = list(range(len(names))) if first_rank_order == "same" else [1, 0, 3, 2, 5, 4]
    exchanged: list[tuple[list[int], str, Any]] = []

    def exchange(states: list[int], name: str) -> list[list[int]]:
        exchanged.append((list(states), name, stalls.where))
        return [states if first_rank_order == "same" else first_rank, states]

    log: dict[str, list[str]] = {"started": [], "waited": []}
    router = Router(plan, params, compression=Compression.none, reduction=Reduction(),
                    backends=lambda *_, **__: _StagedRecorder(log, set(names)), exchange=exchange)
    forward = range(len(params))
    for step in range(3):
        started_at_hooks = []
        for var_index in forward:
            router.mark_ready(var_index)
            started_at_hooks.append(len(log["started"]))
        router.finish()
        expected = names[::-1] if step == 0 else [names[m] for m in first_rank]
        assert log["started"] == log["waited"] == expected, f"step {step}"
        if step > 0 and first_rank_order == "same":
            assert started_at_hooks == list(range(1, len(names) + 1)), "each starts at its own gradient's hook"
        log["started"].clear()
        log["waited"].clear()
    assert exchanged == [(list(forward), f"hybridsync.opt{router.instance}.message_order",
                          ("step", router.instance, 0, None, "order"))], "one agreement, in step 0, named for the watch"


def test_plans_without_staged_messages_agree_on_no_order():
    """A plan without hierarchical messages never pays the agreement's all-gather."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    params = list(model.parameters())
    for param in params:
        param.grad = torch.ones_like(param)
    plan = build_plan(variables_from_model(model), Strategy.from_dict(
        {"version": 1, "default": {"route": "allreduce", "algorithm": "hierarchical"}}))
    waited: list[str] = []

    def exchange(states: list[int], name: str) -> list[list[int]]:
        raise AssertionError(f"no exchange expected, got {name}")

    router = Router(plan, params, compression=Compression.none, reduction=Reduction(),
                    backends=lambda *_, **__: _RecordingBackend(waited), exchange=exchange)
    for _ in range(2):
        for var_index in range(len(params)):
            router.mark_ready(var_index)
        router.finish()
    assert waited == [m.name for m in plan.messages] * 2


@pytest.mark.parametrize("sparse_as_dense", [False, True], ids=["", "sparse_as_dense"])
@pytest.mark.parametrize("reduction", sorted(REDUCTIONS))
@pytest.mark.parametrize("name", sorted(ROWS_STRATEGIES))
def test_rows_give_the_true_reduction_as_dense_gradients(name, reduction, sparse_as_dense):
    """``rows``: each rank's nonzero rows travel (ring: the sparse all-gather; PS: touched-row keys, in
    shards and merge groups), and every rank's dense gradient is the reduction of the dense ones, rows
    that no rank touched zero (``unused.weight``: zero everywhere; ``rank0_only``: one rank's rows)."""
    op = REDUCTIONS[reduction]
    world, plan, routers, results = synchronized(name, False, op, sparse_as_dense=sparse_as_dense)
    for step in range(STEPS):
        local = local_gradients(False, step)
        for index, var in enumerate(plan.var_names):
            expected = sum(g[index] for g in local) * op.prescale_factor * op.result_factor(SIZE)
            for rank in range(SIZE):
                got = results[rank][step][index]
                assert not got.is_sparse, (var, "a rows gradient must go back dense")
                assert torch.allclose(got, expected, atol=2e-3 if var == "fc2.bias" else 1e-6, rtol=1e-5), \
                    (var, rank, step)
    assert not any(router.pending for router in routers)
    assert not any(router._kinds.sparse for router in routers), "rows variables are no sparse ones"
    if name == "rows_ps":
        _assert_pushes_as_predicted(world, plan, "opt7")
        rows_keys = {key.name for keys in plan.ps_keys(num_servers=NUM_SERVERS, partition_bytes=PARTITION_BYTES,
                                                       namespace="opt7").values() for key in keys if key.sparse}
        assert len(rows_keys) == 8  # emb 2 shards, unused in group 4, fc1.weight 3 shards, fc2.weight, rank0_only
        sent = [payload for client in world.clients for _, _, key, payload in client.calls if key in rows_keys]
        assert sent and all(isinstance(p, tuple) for p in sent), "a rows key was pushed dense"
        emb_keys = {"opt7/hybridsync.group4.shard0.emb.weight", "opt7/hybridsync.group4.shard1"}
        emb_rows = [p[0].shape[1] for c in world.clients for _, _, key, p in c.calls if key in emb_keys]
        assert emb_rows and sum(emb_rows) < 30 * STEPS * SIZE, "every row of the embedding travelled"


def test_rows_on_the_ring_travel_as_sparse_all_gathers():
    calls = []
    original = SparseStoreAllreduce.submit_sparse

    def recording(self, name, grad, reduction):
        calls.append((name, grad._nnz()))
        return original(self, name, grad, reduction)
    SparseStoreAllreduce.submit_sparse = recording
    try:
        synchronized("rows_ring", False, Reduction())
    finally:
        SparseStoreAllreduce.submit_sparse = original
    by_name: dict[str, list[int]] = {}
    for name, nnz in calls:
        by_name.setdefault(name, []).append(nnz)
    assert set(by_name) == {"emb.weight", "fc1.weight", "rank0_only.weight", "unused.weight"}
    assert all(len(counts) == SIZE * STEPS for counts in by_name.values())
    assert max(by_name["unused.weight"]) == 0 and sorted(by_name["rank0_only.weight"])[:-STEPS] == [0] * 4
    assert max(by_name["emb.weight"]) < 30  # a batch of 4 x 5 ids touches at most 20 of the 30 rows


def test_nonzero_rows_is_lossless_and_keeps_only_nonzero_rows():
    from hybridsync.router.runtime import nonzero_rows
    grad = torch.zeros(6, 2, 3)
    grad[1, 0, 2], grad[4] = -1.5, 2.0
    grad[5, 1, 1] = float("nan")
    rows = nonzero_rows(grad)
    assert rows.is_sparse and rows.is_coalesced() and rows.indices().tolist() == [[1, 4, 5]]
    assert torch.equal(rows.to_dense().nan_to_num(), grad.nan_to_num())
    assert nonzero_rows(torch.zeros(4, 3))._nnz() == 0 and nonzero_rows(torch.zeros(4, 3)).shape == (4, 3)
    vector = torch.tensor([0.0, 3.0, 0.0])
    assert nonzero_rows(vector).indices().tolist() == [[1]] and torch.equal(nonzero_rows(vector).to_dense(), vector)
    strided = torch.arange(12.0).view(3, 4).t()  # not contiguous: a transposed weight's gradient
    assert torch.equal(nonzero_rows(strided).to_dense(), strided)
