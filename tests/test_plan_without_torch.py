"""The routing plan and PS placement import and run where torch and Horovod cannot be imported:
what the simulator (which never imports them) relies on. A subprocess, so a tier of its own."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.multiprocess


def test_plan_and_placement_import_and_run_without_torch_or_horovod():
    program = textwrap.dedent("""
        import json, sys
        class Blocked:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "horovod"):
                    raise ImportError(f"{name} is blocked: the plan must not need it")
        sys.meta_path.insert(0, Blocked())
        from hybridsync import baselines, envvars, placement
        from hybridsync.explain import explain
        from hybridsync.router.plan import build_plan
        from hybridsync.strategy import Strategy
        from hybridsync.variables import VariableInfo
        variables = {"emb": VariableInfo(name="emb", shape=(1000, 16), sparse=True),
                     "w": VariableInfo(name="w", shape=(64, 32))}
        plan = build_plan(variables, baselines.partitioned_ps(variables, 2, 8000), compression="fp16")
        keys = plan.ps_keys(num_servers=2, partition_bytes=4000, namespace="opt0")
        explain(Strategy(), variables)
        print(json.dumps({"messages": len(plan.messages), "keys": sum(len(k) for k in keys.values()),
                          "torch": "torch" in sys.modules}))
    """)
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["messages"] > 2 and result["keys"] >= result["messages"] and not result["torch"], result
