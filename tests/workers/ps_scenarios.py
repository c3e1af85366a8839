"""One parameter-server worker of a ``tests/test_ps.py`` job (2 servers + 2 workers on loopback).

Usage: ``python tests/workers/ps_scenarios.py SCENARIO OUT_DIR`` with the ``DMLC_*`` settings
in the environment; writes ``OUT_DIR/worker<i>.json`` (the outcome, or the error it met).
Scenarios: ``basic`` (dense BSP sums, sparse rows, payloads that do not match their key),
``async`` (ASP and SSP training), ``loop`` (push-pull until stopped, for failure tests),
``recover_bsp`` and ``recover_asp`` (steps checked exactly, while a test kills or stops a server).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
ASYNC_STEPS = 12


def _seeded(worker: int, step: int, shape: tuple[int, ...], dtype=None):
    import torch
    gen = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(shape, generator=gen, dtype=dtype or torch.float32)


def _dense_messages(worker: int, step: int) -> dict[str, list]:
    """Messages a worker pushes in ``step``: one small, one cut into keys, one mixed-dtype group."""
    import torch
    return {"small": [_seeded(worker, step, (5, 3))],
            "big": [_seeded(worker, step, (300, 100))],  # 120 kB: cut into 30 keys of 4000 B
            "group": [_seeded(worker, step, (7,)), _seeded(worker, step, (4, 4), dtype=torch.float64),
                      _seeded(worker, step, (6, 2)).t()]}  # a non-contiguous member


def _scenario_bsp(client, out: dict) -> None:
    """Dense BSP sums vs the true sums, every message type, several steps."""
    from hybridsync.backends.base import Reduction
    from hybridsync.backends.ps import PSBackend
    backend, me, n = PSBackend(client), client.config.index, client.num_workers
    backend.declare_all([(name, tensors, None) for name, tensors in _dense_messages(me, 0).items()])
    errors = []
    for step in range(STEPS):
        mine = _dense_messages(me, step)
        ops = {"small": Reduction(op="sum"), "big": Reduction(op="average"),
               "group": Reduction(op="sum", prescale_factor=0.5, postscale_factor=3.0)}
        handles = [backend.submit(name, tensors, ops[name]) for name, tensors in mine.items()]
        for handle in reversed(handles):  # any wait order must work
            handle.wait()
        for name, tensors in mine.items():
            for i, got in enumerate(tensors):
                true = sum(_dense_messages(w, step)[name][i] for w in range(n))
                expected = true / n if name == "big" else true * 1.5 if name == "group" else true
                errors.append(float((got - expected).abs().max()))
    out["max_error"] = max(errors)
    loads = [0, 0]
    for chunk in [c for name, ts in _dense_messages(me, 0).items() for c in client.layout(name, ts).chunks]:
        loads[client.placement[chunk.key]] += chunk.nbytes
    out["server_loads"] = loads
    out["counters"] = client.counters.as_dict()


def _scenario_sparse(client, out: dict) -> None:
    """Embedding rows: each worker touches its own rows plus shared ones; result is the union."""
    import torch
    from hybridsync.backends.base import Reduction
    from hybridsync.backends.ps import PSBackend
    me, rows = client.config.index, 100_000
    emb = torch.nn.Embedding(rows, 16, sparse=True)
    touched = torch.tensor([10 * me + 1, 10 * me + 2, 500, 500])  # row 500: both workers, twice each
    emb(touched).sum().backward()
    before = dict(client.counters.as_dict())
    result = PSBackend(client).submit_sparse("emb.weight", emb.weight.grad, Reduction(op="sum"))().coalesce()
    out["rows"] = result.indices()[0].tolist()
    out["row500"] = result.values()[result.indices()[0].tolist().index(500)].tolist()
    out["sparse_pushed_bytes"] = client.counters.pushed_bytes - before["pushed_bytes"]
    out["dense_bytes"] = emb.weight.nbytes


def _scenario_mismatch(client, out: dict) -> None:
    """Payloads that do not match their key, sent straight to its server (no client checks):
    each is answered with a readable error, and the key still works afterwards."""
    import torch
    from torch.distributed import rpc
    from hybridsync.backends.ps import group, server
    from hybridsync.backends.ps.client import _first_line as first_line
    target = group.server_name(client.server_of("small"))  # dense float32 [15] since _scenario_bsp
    bad = {"sparse": ("rpc_push_pull_sparse", (torch.tensor([[1]]), torch.ones(1, 3), (5, 3))),
           "dtype": ("rpc_push_pull", torch.ones(15, dtype=torch.float64)),
           "malformed": ("rpc_push_pull", "not a tensor")}
    out["mismatch"] = {}
    for case, (function, payload) in bad.items():
        try:
            answer = rpc.rpc_sync(target, getattr(server, function),
                                  args=("small", client.config.index, STEPS, payload), timeout=20)
            out["mismatch"][case] = f"accepted: {answer!r}"
        except Exception as e:  # noqa: BLE001 - the error text is what the test judges
            out["mismatch"][case] = first_line(e)  # what PSServerError would say after the server's name


def _scenario_loop(client, out_dir: Path) -> None:
    """Push-pull keys on both servers forever; signal readiness after the first step."""
    import torch
    from hybridsync.backends.base import Reduction
    from hybridsync.backends.ps import PSBackend
    backend, me = PSBackend(client), client.config.index
    tensors = {f"key{s}": torch.ones(1000) for s in range(client.config.num_servers)}
    for s, (name, t) in enumerate(tensors.items()):
        backend.declare(name, [t], server=s)
    step = 0
    while True:
        for handle in [backend.submit(name, [t], Reduction()) for name, t in tensors.items()]:
            handle.wait()
        step += 1
        if step == 2:
            (out_dir / f"ready{me}").touch()
        time.sleep(0.01)


RECOVER_STEPS = int(os.environ.get("PS_TEST_STEPS", "60"))


def _recover_bsp(client, out_dir: Path, out: dict) -> None:
    """BSP steps of dense keys on every server and a sparse key, each result compared bitwise with
    the sum the server computes (``sum_dense``/``sum_sparse``, worker order)."""
    import torch
    from hybridsync.backends.base import Reduction
    from hybridsync.backends.ps import PSBackend
    from hybridsync.backends.ps.store import sum_dense, sum_sparse
    backend, me, n = PSBackend(client), client.config.index, client.num_workers
    shapes = {f"key{s}": (300, 40) for s in range(client.config.num_servers)}  # 48 kB: 12 keys each
    for s, (name, shape) in enumerate(shapes.items()):
        backend.declare(name, [torch.empty(shape)], server=s)
    mismatches = []
    for step in range(RECOVER_STEPS):
        mine = {name: _seeded(me, step, shape) for name, shape in shapes.items()}
        rows = torch.tensor([[me, 7, 20 + step % 5]])
        sparse = torch.sparse_coo_tensor(rows, torch.full((3, 4), float(step + me)), (50, 4))
        handles = [backend.submit(name, [t], Reduction(op="sum")) for name, t in mine.items()]
        got_sparse = backend.submit_sparse("emb", sparse, Reduction(op="sum"))().coalesce()
        for handle in handles:
            handle.wait()
        for name, got in mine.items():
            if not torch.equal(got, sum_dense([_seeded(w, step, shapes[name]) for w in range(n)])):
                mismatches.append(f"{name} step {step}")
        parts = []
        for w in range(n):
            theirs = torch.sparse_coo_tensor(torch.tensor([[w, 7, 20 + step % 5]]),
                                             torch.full((3, 4), float(step + w)), (50, 4)).coalesce()
            parts.append((theirs.indices(), theirs.values(), (50, 4)))
        indices, values, _ = sum_sparse(parts)
        if not (torch.equal(got_sparse.indices(), indices) and torch.equal(got_sparse.values(), values)):
            mismatches.append(f"emb step {step}")
        if step == 2:
            (out_dir / f"ready{me}").touch()
        time.sleep(0.05)
    out.update(mismatches=mismatches, steps=RECOVER_STEPS)


def _recover_asp(client, out_dir: Path, out: dict) -> None:
    """ASP steps adding a known delta to parameters on every server: once every worker is done, the
    servers' values must hold every delta exactly once (small integers: float sums are exact)."""
    import torch
    from hybridsync.backends.ps.asp import AsyncParameterSync
    me, n = client.config.index, client.num_workers
    params = [torch.zeros(3000) for _ in range(client.config.num_servers)]  # 12 kB: 3 keys each
    sync = AsyncParameterSync(client, [(f"p{s}", p) for s, p in enumerate(params)],
                              servers={f"p{s}": s for s in range(len(params))})
    for step in range(RECOVER_STEPS):
        for param in params:
            param.add_(me + 1)
        sync.push_pull()
        if step == 2:
            (out_dir / f"ready{me}").touch()
        time.sleep(0.05 * (me + 1))
    (out_dir / f"done{me}").touch()
    # a worker that failed writes its result instead: stop waiting, so the test shows its error at once
    deadline = time.monotonic() + 120
    while not all((out_dir / f"done{w}").exists() or (out_dir / f"worker{w}.json").exists() for w in range(n)) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    sync.pull()
    expected = RECOVER_STEPS * sum(w + 1 for w in range(n))
    out.update(values=sorted({float(v) for p in params for v in p.unique()}), expected=float(expected))


def _train(client, staleness: int | None, out: dict) -> None:
    """A 4-class linear classifier on synthetic blobs; worker 1 is slow. Accuracy and waits recorded."""
    import torch
    from hybridsync.backends.ps.asp import AsyncParameterSync
    me, tag = client.config.index, "asp" if staleness is None else f"ssp{staleness}"
    gen = torch.Generator().manual_seed(7)
    centers = torch.randn(4, 10, generator=gen) * 3
    labels = torch.randint(0, 4, (800,), generator=gen)
    data = centers[labels] + torch.randn(800, 10, generator=gen)
    torch.manual_seed(me)  # different initial weights: the servers keep the first worker's
    model = torch.nn.Linear(10, 4)
    sync = AsyncParameterSync(client, [(f"{tag}.{n}", p) for n, p in model.named_parameters()], staleness=staleness)
    shard = slice(me * 300, (me + 1) * 300)  # rows 600.. are the test set
    for step in range(ASYNC_STEPS):
        batch = torch.arange(step * 30, step * 30 + 30) % 300
        loss = torch.nn.functional.cross_entropy(model(data[shard][batch]), labels[shard][batch])
        model.zero_grad()
        loss.backward()
        with torch.no_grad():  # plain SGD; torch.optim's import alone costs seconds on a busy box
            for param in model.parameters():
                param.add_(param.grad, alpha=-0.1)
        sync.push_pull()
        if me == 1:
            time.sleep(0.1)
    accuracy = (model(data[600:]).argmax(1) == labels[600:]).float().mean().item()
    out[tag] = {"accuracy": accuracy, "waited_s": sync.waited_s, "servers": client.server_counters()}


def worker_main(scenario: str, out_dir: Path) -> int:
    """One PS worker process of a test job; the outcome (or error) goes to a json file."""
    from hybridsync.backends import ps
    out: dict = {}
    client = ps.init(ping_timeout_s=float(os.environ.get("PS_TEST_PING_TIMEOUT", "10")))
    try:
        if scenario == "basic":
            _scenario_bsp(client, out)
            _scenario_sparse(client, out)
            _scenario_mismatch(client, out)
            out["index"] = client.config.index
        elif scenario == "async":
            _train(client, None, out)
            _train(client, 1, out)
        elif scenario == "recover_bsp":
            _recover_bsp(client, out_dir, out)
        elif scenario == "recover_asp":
            _recover_asp(client, out_dir, out)
        else:
            _scenario_loop(client, out_dir)
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        out.update(error_type=type(e).__name__, error=str(e), error_time=time.time())
    out["recoveries"] = [{"server": r.server, "incarnation": r.incarnation, "seconds": r.seconds, "keys": r.keys,
                          "resent": r.resent, "error": r.error} for r in client.recoveries]
    (out_dir / f"worker{client.config.index}.json").write_text(json.dumps(out))
    ps.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(worker_main(sys.argv[1], Path(sys.argv[2])))
