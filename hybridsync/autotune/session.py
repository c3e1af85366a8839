"""One autotune session, shared by ``hybridsync search`` and ``hybridsync-run --autotune``:
the model description, the cluster, where trials run, and the loop with its report."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # the loop needs numpy and the search; `hybridsync --help` must not
    from hybridsync.autotune.loop import AutotuneResult, AutotuneSettings


def load_cluster(path: str) -> Any:
    """A ``ClusterSpec`` from a spec YAML or from a run config's ``hybridsync: cluster:``;
    ``ValueError`` naming the file when it cannot be read (a mistyped path was a traceback)."""
    import yaml

    from hybridsync.cluster.spec import ClusterSpec
    try:
        with open(path, encoding="utf-8") as handle:
            doc = yaml.safe_load(handle) or {}
    except OSError as error:
        raise ValueError(f"cannot read the cluster spec {path}: {error.strerror or error}") from None
    if isinstance(doc, dict) and isinstance(doc.get("hybridsync"), dict):
        from hybridsync.run.config import load_run_config
        spec = load_run_config(path).cluster
        if spec is None:
            raise ValueError(f"{path}: its hybridsync: section has no cluster: spec")
        return spec
    return ClusterSpec.from_yaml(path)


def load_or_profile(model: str) -> Any:
    """A profiled description from a file, or a zoo model profiled now (one process, ~30 s)."""
    from hybridsync.description import load_description
    if os.path.exists(model):
        description = load_description(model)
        if description.timing is None:
            raise ValueError(f"{model}: has no compute timing; the search needs a profiled description "
                             f"(hybridsync profile -o {model} -- python train.py)")
        return description
    from hybridsync.zoo import ZOO_MODELS, is_model
    if not is_model(model):
        raise ValueError(f"--model {model!r} is neither a file nor a zoo model ({', '.join(ZOO_MODELS)}, "
                         f"or generated: gen-<family>-<k>)")
    from hybridsync.run.profile import profile_command
    print(f"profiling the zoo model {model} (one process)...", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="hybridsync-profile-") as folder:  # read back, then removed
        return profile_command([sys.executable, "-m", "hybridsync.zoo.train", "--model", model, "--steps", "1000"],
                               output=os.path.join(folder, f"{model}.json"), name=model)


def load_simulator(path: str | None) -> Any:
    from hybridsync.model.simulator import Simulator, shipped_simulator
    return Simulator.load(path) if path else shipped_simulator()


def trial_target(cluster: Any, *, hosts: str | None = None, hostfile: str | None = None) -> Any:
    """Real hosts when given, else the spec emulated on this machine (root needed)."""
    from hybridsync.trials.jobs import EmulatedTarget, HostsTarget
    if hosts or hostfile:
        return HostsTarget(cluster, hosts=hosts, hostfile=hostfile)
    check_emulated_target(cluster)
    return EmulatedTarget(cluster)


def check_emulated_target(cluster: Any) -> None:
    """``ValueError`` if the trials cannot run on ``cluster`` emulated here (not root, too large for
    this machine, latency without the kernel's netem): asked before the profile, so the user hears it
    in a second, not after it."""
    if os.geteuid() != 0:
        raise ValueError("trials on the emulated cluster need root (network namespaces); run as root, or measure "
                         "on real hosts with -H/--hostfile")
    from hybridsync.cluster.netns import check_can_emulate
    check_can_emulate(cluster)


def workload_for(model: str | None, command: Sequence[str]) -> Any:
    """The user's script when given, else the zoo model's trial worker."""
    from hybridsync.trials.runner import ScriptWorkload, ZooWorkload
    if command:
        return ScriptWorkload(tuple(command))
    from hybridsync.zoo import is_model
    if model is None or not is_model(model):
        raise ValueError(f"the description names model {model!r}, which is not a zoo model: give the training "
                         f"script to measure trials with after --, e.g. -- python train.py")
    return ZooWorkload(model)


def autotune(description: Any, cluster: Any, *, target: Any, workload: Any, settings: "AutotuneSettings",
             store_url: str, report_dir: str, simulator: str | None = None, workdir: str | None = None) -> "AutotuneResult":
    """Runs the autotune loop on ``target`` (entered by the caller: it lives as long as the caller
    needs the cluster) and writes the report into ``report_dir``; returns the result. Without a
    ``workdir``, the trial jobs' schedules, logs and confirmation store go to a temporary folder,
    removed when every trial ran; kept, and named in the summary, when one failed (its log says why)."""
    from hybridsync.autotune.loop import Autotuner
    from hybridsync.autotune.report import write_report
    from hybridsync.description import description_id
    from hybridsync.trials.runner import TrialRunner, ZooWorkload
    from hybridsync.trials.store import TrialStore
    temporary = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="hybridsync-autotune-")
    desc_id = description_id(description)
    name = description.name or "model"

    def runner_for(protocol: Any, store: Any) -> TrialRunner:
        return TrialRunner(model=name, description_id=desc_id, target=target, store=store, protocol=protocol,
                           workdir=workdir, seed=settings.seed, workload=workload)

    with TrialStore(store_url) as store, TrialStore(os.path.join(workdir, "confirm.db")) as confirm_store:
        tuner = Autotuner(description=description, cluster=cluster, store=store, runner_for=runner_for,
                          simulator=load_simulator(simulator), settings=settings,
                          with_horovod=isinstance(workload, ZooWorkload), confirm_store=confirm_store)
        result = tuner.run()
    write_report(result, report_dir)
    failed = any(t.measured_s is None for t in result.trials)
    if temporary and not failed:
        shutil.rmtree(workdir, ignore_errors=True)
    tau, resolved = result.kendall_tau, result.resolved_tau
    print(f"autotune: {result.verdict()}; trials vs confirmation Kendall tau "
          f"{'-' if tau is None else f'{tau:.2f}'} (over the pairs it resolves: "
          f"{'-' if resolved is None else f'{resolved:.2f}'}); {len(result.trials)} trials, "
          f"{result.seconds['total']:.0f} s; report in {report_dir}"
          + (f"; the trial jobs' logs in {workdir}" if failed else "")
          + (f"\nautotune: {result.rivals_only}" if result.rivals_only else ""))
    return result

