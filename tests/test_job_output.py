"""What a job prints and loads: the training script's lines, the servers' own, and nothing a user must
ignore; no TensorFlow or toolchain library in any process of a torch job.

One short ``hybridsync-run`` job (horovodrun, Gloo) of ``examples/train.py`` per route: none (no
strategy); ring; hierarchical on two "hosts" (4 ranks, ``localhost:2,127.0.0.1:2``); the parameter
server with a BSP and an ASP variable; fp16, groups and partitions; the last two with a sparse
embedding. Every line of their output must match the allow-list below, so a warning from torch,
TensorFlow, Horovod or hybridsync (the launcher's included) fails the test. Each job runs with
``PYTHONPROFILEIMPORTTIME=1``: every Python process of it (the launcher and the children it forks,
the ranks, the servers) prints each module it imports, until it exits. The emulated hosts, where
torch's store clients used to warn that no host name could be found, are checked on the emulated
tier's own job (test_emulated.py).
"""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

from conftest import BIN, REPO, SERVER_LINES, run_job, unexpected_lines

EXAMPLE_LINES = (
    r"\d+ ranks; \d+ variables sent as \d+ messages per step:",
    r"  \S+ +(allreduce/(ring|hierarchical)|ps/(bsp|asp)) +(-|fp16) +<- \S.*",
    r"step +\d+  loss \d+\.\d+",
    r"\d+ steps in [\d.]+ s \([\d.]+ ms/step\); training accuracy over the last \d+ steps: [\d.]+%",
)
"""``examples/train.py``'s own prints (rank 0): the plan, the loss, the speed and accuracy."""

IMPORT_LINE = r"(\[\d+\]<stderr>:)?import time: +(self \[us\]|-?\d+) +\| +(cumulative|-?\d+) +\| +(?P<module>.+)"
"""What ``PYTHONPROFILEIMPORTTIME`` prints (on the C level's stderr) per module a process imports (a rank's
line with horovodrun's prefix; a self time is negative where another thread imported meanwhile)."""
HEAVY_MODULES = ("tensorflow", "keras", "tf_keras", "jax", "xgboost", "matplotlib", "pandas", "optuna",
                 "nevergrad", "sklearn", "scipy")
"""What a torch job must never import: seconds and hundreds of MB per process, for nothing."""

RING = {"route": "allreduce", "algorithm": "ring"}
JOBS = {
    "none": (2, "localhost:2", None, []),
    "ring": (2, "localhost:2", {"default": RING}, []),
    "hierarchical": (4, "localhost:2,127.0.0.1:2", {"default": {"route": "allreduce",
                                                                "algorithm": "hierarchical"}}, []),
    "ps_bsp_asp": (2, "localhost:2", {"default": RING, "variables": {
        "emb.weight": {"route": "ps", "protocol": "bsp", "partitions": 2},
        "fc2.weight": {"route": "ps", "protocol": "asp"}}}, ["--sparse"]),
    "fp16_groups_partitions": (2, "localhost:2", {"default": RING, "variables": {
        "emb.weight": {"route": "allreduce", "compression": "fp16"},
        "fc1.weight": {"route": "allreduce", "group": 1}, "fc1.bias": {"route": "allreduce", "group": 1},
        "fc2.weight": {"route": "allreduce", "partitions": 2, "compression": "fp16"},
        **{name: {"route": "allreduce", "group": 2, "compression": "fp16"}
           for name in ("fc2.bias", "head.weight", "head.bias")}}}, ["--sparse"]),
}
STEPS = 3


_outputs: dict[str, tuple[str, list[str]]] = {}


def _job_output(tmp_path_factory, name: str) -> tuple[str, list[str]]:
    """Job ``name``'s output without its import-time lines, and the modules those lines name (run once)."""
    if name not in _outputs:
        np, hosts, strategy, example_args = JOBS[name]
        path = tmp_path_factory.mktemp(f"job-output-{name}") / "strategy.json"
        path.write_text(json.dumps({"version": 1, **(strategy or {})}))
        argv = [str(BIN / "hybridsync-run"), "-np", str(np), "-H", hosts, "--gloo",
                *(["--strategy", str(path)] if strategy else []),
                sys.executable, str(REPO / "examples" / "train.py"), "--steps", str(STEPS), *example_args]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_", "TF_"))}
        proc = run_job(argv, timeout=180, env={**env, "PYTHONPROFILEIMPORTTIME": "1"})
        imports = [re.fullmatch(IMPORT_LINE, line) for line in proc.stdout.splitlines()]
        output = "\n".join(line for line, match in zip(proc.stdout.splitlines(), imports) if match is None)
        assert proc.returncode == 0, output[-5000:]
        _outputs[name] = output, [match["module"].strip() for match in imports if match is not None]
    return _outputs[name]


@pytest.mark.parametrize("name", sorted(JOBS))
@pytest.mark.multiprocess
def test_job_prints_only_the_scripts_and_servers_lines(tmp_path_factory, name):
    output, _ = _job_output(tmp_path_factory, name)
    assert unexpected_lines(output, (*EXAMPLE_LINES, *SERVER_LINES)) == [], output[-5000:]
    np, _, strategy, _ = JOBS[name]
    assert f"{np} ranks; 7 variables" in output and f"{STEPS} steps in" in output  # the job did train
    assert f"over the last {STEPS} steps:" in output  # a short run says what its accuracy is over
    assert output.count("serving (rank") == int('"route": "ps"' in json.dumps(strategy))  # its server, if any


@pytest.mark.parametrize("name", sorted(JOBS))
@pytest.mark.multiprocess
def test_a_torch_job_imports_no_tensorflow_nor_toolchain_library(tmp_path_factory, name):
    """No process of a torch job, from the launcher to the last rank's exit, imports TensorFlow (or Keras,
    XGBoost, matplotlib, pandas, Optuna, nevergrad...): swapping the import never slows a job. Before,
    the launcher's build check imported ``horovod.tensorflow`` in a forked child: 8.9-13.3 s (3.5 s of
    CPU) of a loaded machine before any rank started, and TensorFlow's start-up lines."""
    _, modules = _job_output(tmp_path_factory, name)
    np = JOBS[name][0]
    processes = modules.count("imported package")  # the heading each process prints before its first import
    assert processes >= np + 2 and modules.count("torch") >= np, \
        f"{processes} processes listed their imports: hybridsync-run's, horovodrun's and each rank's at least"
    heavy = sorted({module.split(".")[0] for module in modules} & set(HEAVY_MODULES))
    assert heavy == [], f"a torch job imported {heavy}"


@pytest.mark.multiprocess
def test_launcher_quiet_ranks_environment_untouched(tmp_path):
    """The launcher's TensorFlow lines are gone, yet the ranks get the environment the user gave."""
    probe = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in "
             "('TF_CPP_MIN_LOG_LEVEL', 'TF_ENABLE_ONEDNN_OPTS')}))")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TF_")}, "TF_ENABLE_ONEDNN_OPTS": "1"}
    proc = run_job([str(BIN / "hybridsync-run"), "-np", "1", "-H", "localhost:1", "--gloo",
                    sys.executable, "-c", probe], timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert unexpected_lines(proc.stdout, [r"\{.*\}"]) == [], proc.stdout[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1].split(":", 1)[1])
    assert seen == {"TF_CPP_MIN_LOG_LEVEL": None, "TF_ENABLE_ONEDNN_OPTS": "1"}


@pytest.mark.multiprocess
def test_a_failed_rank_ends_in_one_line_not_horovodruns_traceback(tmp_path):
    """A training script that fails: its ranks' lines, Horovod's lines about the processes (the
    other rank stopped with SIGTERM if it was still running), then one line saying which rank
    failed first, exit status 1 (as before); no traceback of horovodrun's internals (it was 20
    lines, ending in ``RuntimeError: Horovod detected...``). The rank's line is one ``print``
    argument: ``print('rank', r, 'fails')`` writes it in five pieces (unbuffered, as horovodrun runs
    ranks), and a rank stopped between two of them leaves a piece of it."""
    script = "import os, sys; print(f\"rank {os.environ['HOROVOD_RANK']} fails\"); sys.exit(3)"
    proc = run_job([str(BIN / "hybridsync-run"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-c",
                    script], timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    unexpected = unexpected_lines(proc.stdout, [
        r"rank \d fails", r"Process \d exit with status code (3|143)\.",
        r"Terminating remaining workers after failure of Process \d\.",
        r"Terminated",  # the other rank, if still running, is stopped (143)
        r"hybridsync-run: error: rank \d exited with status 3, the first to fail; "
        r"horovodrun stopped the others \(the ranks' output above says why\)"])
    assert unexpected == [], f"unexpected lines {unexpected} in:\n{proc.stdout[-3000:]}"


@pytest.mark.multiprocess
def test_a_rank_stopped_inside_a_line_leaves_it_on_its_own_line(tmp_path):
    """Rank 1 wrote part of a line when rank 0 failed and horovodrun stopped it: Horovod forwarded the
    piece without a newline, and its own next line was glued to it (``[1]<stdout>:rankProcess 1 exit
    with status code 143.``, seen under load with a rank stopped inside a ``print``)."""
    written = tmp_path / "rank1-wrote"
    script = ("import os, pathlib, sys, time\n"
              "written = pathlib.Path(sys.argv[1])\n"
              "if os.environ['HOROVOD_RANK'] == '1':\n"
              "    sys.stdout.write('half a line'); sys.stdout.flush(); written.touch(); time.sleep(100)\n"
              "deadline = time.monotonic() + 60\n"
              "while not written.exists() and time.monotonic() < deadline:\n"
              "    time.sleep(0.05)\n"
              "sys.exit(3)\n")
    proc = run_job([str(BIN / "hybridsync-run"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-c",
                    script, str(written)], timeout=120)
    assert proc.returncode == 1 and written.exists(), proc.stdout[-3000:]
    # The next line is Horovod's "Process 1 exit with status code 143." or, when horovodrun ends first, ours.
    assert [line for line in proc.stdout.splitlines() if "half a line" in line] == ["[1]<stdout>:half a line"], \
        proc.stdout[-3000:]


@pytest.mark.unit
def test_forwarded_output_ends_inside_no_line():
    """Horovod's own forwarder of a rank's output (a pipe read to its end) writes the last piece of a
    line as it is; ``lines_ended`` ends it, and adds nothing to output that ends with its line."""
    import io
    import multiprocessing

    from horovod.runner.common.util.safe_shell_exec import prefix_connection

    from hybridsync.run.horovodrun import lines_ended

    def forwarded(data: bytes) -> str:
        receiver, sender = multiprocessing.Pipe(duplex=False)
        os.write(sender.fileno(), data)
        sender.close()
        out = io.StringIO()
        lines_ended(prefix_connection)(receiver, out, "stdout", 1, False)
        return out.getvalue()

    assert forwarded(b"a line\nhalf a") == "[1]<stdout>:a line\n[1]<stdout>:half a\n"
    assert forwarded(b"a line\n") == "[1]<stdout>:a line\n"
    assert forwarded(b"50%\r") == "[1]<stdout>:50%\r"
    assert forwarded(b"") == ""
