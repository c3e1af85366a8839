"""The autotune report: JSON for machines, Markdown for people, a PNG for both.

- ``report.json``: the winner (kind and strategy), every trial (round, kind, predicted and
  measured step time), the confirmation job's step time per kind, the speedups of the
  winner over each baseline and over plain Horovod, and the wall time of each phase;
- ``report.md``: the same as tables;
- ``report.png``: predicted vs measured per trial, and the best step time so far against
  trials measured, with the best baseline's line.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from hybridsync.autotune.loop import AutotuneResult
from hybridsync.model.evaluate import describe_live, live_accuracy
from hybridsync.trials.store import cluster_label


def to_dict(result: AutotuneResult) -> dict[str, Any]:
    """The report as a JSON-ready document."""
    best = result.best_baseline
    return {
        "model": result.model, "cluster": result.cluster.to_dict(), "cluster_label": cluster_label(result.cluster.to_dict()),
        "winner": {"kind": result.winner_kind, "step_s": result.confirmed_s[result.winner_kind],
                   "strategy": result.winner.to_dict()},
        "best_baseline": None if best is None else {"kind": best[0], "step_s": best[1]},
        "speedup_over_best_baseline": None if best is None else best[1] / result.confirmed_s[result.winner_kind],
        "speedups": {kind: result.speedup_over(kind) for kind in sorted(result.confirmed_s)},
        "confirmed_s": dict(sorted(result.confirmed_s.items(), key=lambda item: item[1])),
        "trials": [dataclasses.asdict(t) for t in result.trials],
        "best_so_far_s": result.best_so_far(),
        "simulator_accuracy": live.to_dict() if (live := live_accuracy(result.trials)) else None,
        "seconds": result.seconds,
    }


def write_report(result: AutotuneResult, directory: str | os.PathLike[str]) -> list[Path]:
    """Writes ``report.json``, ``report.md`` and ``report.png`` into ``directory``; returns their paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    doc = to_dict(result)
    (out / "report.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    (out / "report.md").write_text(markdown(doc), encoding="utf-8")
    plot(doc, out / "report.png")
    return [out / "report.json", out / "report.md", out / "report.png"]


def markdown(doc: dict[str, Any]) -> str:
    """The report document as Markdown."""
    winner, best = doc["winner"], doc["best_baseline"]
    lines = [f"# Autotune: {doc['model']} on {doc['cluster_label']}", ""]
    lines.append(f"Winner: **{winner['kind']}**, {winner['step_s'] * 1e3:.1f} ms per step in the confirmation job.")
    if best is not None:
        lines.append(f"Best hand-made choice: {best['kind']}, {best['step_s'] * 1e3:.1f} ms: the winner is "
                     f"**{doc['speedup_over_best_baseline']:.2f}x** as fast.")
    seconds = doc["seconds"]
    lines += ["", describe_live(doc.get("simulator_accuracy"))]
    lines += ["", "Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()), "",
              "## Confirmation job (one job, interleaved repeats)", "", "| kind | ms per step | winner's speedup |",
              "| --- | ---: | ---: |"]
    for kind, step_s in doc["confirmed_s"].items():
        lines.append(f"| {kind} | {step_s * 1e3:.1f} | {doc['speedups'][kind]:.2f}x |")
    lines += ["", "## Trials", "", "| # | round | kind | predicted ms | measured ms |", "| ---: | ---: | --- | ---: | ---: |"]
    for i, trial in enumerate(doc["trials"], 1):
        measured = "failed" if trial["measured_s"] is None else f"{trial['measured_s'] * 1e3:.1f}"
        predicted = "-" if trial["predicted_s"] is None else f"{trial['predicted_s'] * 1e3:.1f}"
        lines.append(f"| {i} | {trial['round']} | {trial['kind']} | {predicted} | {measured} |")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Predicted vs measured per trial, and best-so-far vs trials (with the best baseline)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = [t for t in doc["trials"] if t["measured_s"] is not None and t["predicted_s"] is not None]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for prefix, color in (("baseline:", "tab:orange"), ("horovod", "tab:red"), ("search", "tab:blue")):
        chosen = [t for t in trials if t["kind"].startswith(prefix)]
        left.scatter([t["measured_s"] * 1e3 for t in chosen], [t["predicted_s"] * 1e3 for t in chosen], s=18,
                     color=color, label=prefix.rstrip(":"))
    if trials:
        low = min(min(t["measured_s"], t["predicted_s"]) for t in trials) * 1e3 * 0.9
        high = max(max(t["measured_s"], t["predicted_s"]) for t in trials) * 1e3 * 1.1
        left.plot([low, high], [low, high], color="gray", linewidth=0.8)
    left.set(xlabel="measured ms per step", ylabel="predicted ms per step", title="simulator vs trials")
    left.legend()
    best = [b * 1e3 for b in doc["best_so_far_s"]]
    right.plot(range(1, len(best) + 1), best, drawstyle="steps-post", label="best measured so far")
    if doc["best_baseline"] is not None:
        right.axhline(doc["best_baseline"]["step_s"] * 1e3, color="tab:orange", linestyle="--",
                      label=f"best baseline (confirmed): {doc['best_baseline']['kind']}")
    right.axhline(doc["winner"]["step_s"] * 1e3, color="tab:green", linestyle=":", label="winner (confirmed)")
    right.set(xlabel="trials measured", ylabel="ms per step", title="best so far")
    right.legend(fontsize=8)
    figure.suptitle(f"autotune: {doc['model']} on {doc['cluster_label']}")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
