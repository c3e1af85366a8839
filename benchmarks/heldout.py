"""A held-out script's autotune winner side by side with what a Horovod user would pick by hand (issue 21 §4-5).

    sudo .venv/bin/python benchmarks/heldout.py --description two_tower.json --winner autotune/strategy.json \\
        [--cluster horovodrun_configs/cluster_2x2_1gbit.yaml] [--baseline horovod-hierarchical] [--rounds 2] \\
        [--out DIR] -- python examples/heldout/two_tower.py --steps 2000

On one emulated cluster that lives for the whole run:

1. **one job** of the script measuring, interleaved ``--repeats`` times (the autotuner's
   confirmation protocol), the ``allreduce`` baseline (hybridsync's plain Horovod: every
   variable ring all-reduced), each ``--baseline`` (the autotune's best ones) and its fp16
   twin where it has one, the hand mix (``search.seeds``: embeddings whole on the PS, dense
   layers merged hierarchically with the largest alone) and the hand fp16 mix, and the winner;
2. **alternating jobs**, ``--rounds`` times: the script with plain ``horovod.torch``
   (``--optimizer horovod``), then with the winner (``HYBRIDSYNC_STRATEGY``); each job's
   median step time is the script's own printout. Horovod with ``Compression.fp16`` is run
   only if the model has no sparse gradient (Horovod 0.28.1 crashes on them; reported so).

Prints and writes ``side_by_side.json``/``.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hybridsync import baselines  # noqa: E402
from hybridsync.autotune.launch import run_on  # noqa: E402
from hybridsync.autotune.loop import AutotuneSettings  # noqa: E402
from hybridsync.autotune.session import load_cluster  # noqa: E402
from hybridsync.description import description_id, load_description  # noqa: E402
from hybridsync.search.seeds import structured_seeds  # noqa: E402
from hybridsync.strategy import Strategy  # noqa: E402
from hybridsync.strategy_space import bounds_for  # noqa: E402
from hybridsync.trials.candidates import Candidate  # noqa: E402
from hybridsync.trials.jobs import EmulatedTarget  # noqa: E402
from hybridsync.trials.runner import ScriptWorkload, TrialRunner  # noqa: E402
from hybridsync.trials.store import TrialStore  # noqa: E402

HAND_MIX, HAND_FP16_MIX = "sparse-ps-dense-merged", "sparse-ps-dense-merged-fp16"
MEDIAN = re.compile(r"median step ([0-9.]+) ms")


def lineup(description, cluster, winner: Strategy, names: list[str]) -> tuple[list[Candidate], str]:
    """The strategies of the one-job comparison, equal strategies once (first name), and the
    winner's kind there (``winner``, or the baseline or hand mix it equals)."""
    variables, servers = description.variables, cluster.num_servers
    seeds = dict(structured_seeds(variables, bounds_for(cluster)))
    named = [("baseline:allreduce", baselines.build_baseline("allreduce", variables, servers))]
    for name in names:
        named.append((f"baseline:{name}", baselines.build_baseline(name, variables, servers)))
        if name in baselines.TWINS:
            try:
                named.append((f"baseline:{name}{baselines.FP16_SUFFIX}",
                              baselines.build_baseline(name + baselines.FP16_SUFFIX, variables, servers)))
            except ValueError as error:
                print(f"baseline:{name}{baselines.FP16_SUFFIX}: {error}")
    named += [(f"hand:{HAND_MIX}", seeds[HAND_MIX]), (f"hand:{HAND_FP16_MIX}", seeds[HAND_FP16_MIX]),
              ("winner", winner)]
    out: dict[str, Candidate] = {}
    for kind, strategy in named:
        out.setdefault(strategy.fingerprint(), Candidate(kind=kind, strategy=strategy))
    return list(out.values()), out[winner.fingerprint()].kind


def one_job(target, description, candidates: list[Candidate], command: list[str], repeats: int,
            workdir: str) -> dict[str, float]:
    """Median step time (s) per kind, every candidate measured ``repeats`` times interleaved in one job."""
    settings = AutotuneSettings()
    with TrialStore(os.path.join(workdir, "side_by_side.db")) as store:
        runner = TrialRunner(model=description.name or "model", description_id=description_id(description),
                             target=target, store=store, protocol=settings.confirm_protocol, workdir=workdir,
                             workload=ScriptWorkload(tuple(command)))
        runner.run(candidates * repeats)
        steps: dict[str, list[float]] = {}
        for record in store.trials(status="ok"):
            steps.setdefault(record.kind, []).extend(record.timed_steps)
    return {kind: statistics.median(times) for kind, times in steps.items()}


def alternating_jobs(target, command: list[str], winner_path: str, rounds: int, steps: int,
                     workdir: str) -> dict[str, list[float]]:
    """Per job kind (``horovod``, ``winner``), each round's median step time (s) as the script prints it
    (``--steps`` appended: the script's last one wins)."""
    out: dict[str, list[float]] = {"horovod": [], "winner": []}
    for r in range(rounds):
        for kind in out:
            job_command = command + ["--steps", str(steps)] + (["--optimizer", "horovod"] if kind == "horovod" else [])
            env = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
            if kind == "winner":
                env["HYBRIDSYNC_STRATEGY"] = winner_path
            log_path = os.path.join(workdir, f"round{r}-{kind}.log")
            with open(log_path, "w", encoding="utf-8") as log:
                code = run_on(target, job_command, env, log, timeout_s=1200)
            with open(log_path, encoding="utf-8") as log:
                found = MEDIAN.findall(log.read())
            if code != 0 or not found:
                raise RuntimeError(f"{kind} job of round {r} failed (exit {code}); see {log_path}")
            out[kind].append(float(found[-1]) / 1e3)
            print(f"round {r + 1}: {kind} {out[kind][-1] * 1e3:.1f} ms per step", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--description", required=True, help="the script's profiled description")
    parser.add_argument("--winner", required=True, help="the autotune's strategy.json")
    parser.add_argument("--cluster", default=os.path.join(REPO, "horovodrun_configs", "cluster_2x2_1gbit.yaml"))
    parser.add_argument("--baseline", nargs="+", default=["horovod-hierarchical"],
                        help="baselines to compare (each with its fp16 twin): the autotune's best ones")
    parser.add_argument("--repeats", type=int, default=AutotuneSettings().confirm_repeats)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--job-steps", type=int, default=200, help="steps of each alternating job")
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="hybridsync-heldout-"))
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = [w for w in args.command if w != "--"]
    if not command:
        parser.error("give the training script after --")
    os.makedirs(args.out, exist_ok=True)
    description, cluster = load_description(args.description), load_cluster(args.cluster)
    winner = Strategy.load(args.winner)
    candidates, winner_kind = lineup(description, cluster, winner, args.baseline)
    load = [os.getloadavg()[0]]
    with EmulatedTarget(cluster) as target:
        same_job = one_job(target, description, candidates, command, args.repeats, args.out)
        load.append(os.getloadavg()[0])
        jobs = alternating_jobs(target, command, os.path.abspath(args.winner), args.rounds, args.job_steps, args.out)
    load.append(os.getloadavg()[0])
    sparse = any(info.sparse for info in description.variables.values())
    doc = {"winner_kind": winner_kind, "one_job_ms": {k: v * 1e3 for k, v in same_job.items()},
           "alternating_ms": {k: [s * 1e3 for s in v] for k, v in jobs.items()},
           "horovod_fp16": baselines.NOT_RUNNABLE_SPARSE_FP16 if sparse else "not measured", "load": load}
    winner_s = same_job[winner_kind]
    lines = [f"winner: {winner_kind}", "", "| strategy | ms per step (one job) | x winner |", "| --- | ---: | ---: |"]
    lines += [f"| {kind} | {s * 1e3:.1f} | {s / winner_s:.2f}x |" for kind, s in sorted(same_job.items(), key=lambda i: i[1])]
    lines += ["", "| job | " + " | ".join(f"round {r + 1}" for r in range(args.rounds)) + " |",
              "| --- |" + " ---: |" * args.rounds]
    lines += [f"| {kind} | " + " | ".join(f"{s * 1e3:.1f}" for s in v) + " |" for kind, v in jobs.items()]
    lines += ["", f"Horovod with Compression.fp16: {doc['horovod_fp16']}",
              "load average (start, after the one job, end): " + ", ".join(f"{x:.1f}" for x in load)]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "side_by_side.json"), "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=1)
    with open(os.path.join(args.out, "side_by_side.md"), "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
