"""``make demo``: explain the demo strategy, then train with it on 2 local ranks (horovodrun, Gloo) and 2 PS servers."""
from __future__ import annotations

import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hybridsync.explain import explain  # noqa: E402
from hybridsync.run.procs import run_bounded  # noqa: E402
from hybridsync.strategy import Strategy  # noqa: E402
from hybridsync.variables import variables_from_model  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "examples"))
from train import Classifier  # noqa: E402

STRATEGY = os.path.join(REPO, "examples", "strategies", "demo.json")


def main() -> int:
    print("== strategy ==")
    print(explain(Strategy.load(STRATEGY), variables_from_model(Classifier())))
    print("\n== training on 2 ranks + 2 parameter servers: hybridsync-run --strategy "
          "examples/strategies/demo.json --num-servers 2 -np 2 -H localhost:2 --gloo python examples/train.py ==")
    launcher = os.path.join(os.path.dirname(sys.executable), "hybridsync-run")
    proc = run_bounded([launcher, "--strategy", STRATEGY, "--num-servers", "2", "-np", "2", "-H", "localhost:2",
                        "--gloo", sys.executable, os.path.join(REPO, "examples", "train.py")],
                       timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rank0 = [re.sub(r"^\[0\]<stdout>:", "", line) for line in proc.stdout.splitlines()
             if line.startswith("[0]<stdout>:")]
    print("\n".join(rank0) if proc.returncode == 0 else proc.stdout)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
