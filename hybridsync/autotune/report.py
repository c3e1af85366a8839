"""The autotune report: JSON for machines, Markdown for people, a PNG for both.

- ``report.json``: the winner (kind, strategy and the levers it uses), its best fair rival
  and the speedup over it (``hybridsync.autotune.result``: fp16 rivals count when the winner
  uses fp16), the rivals that cannot run on this model and why, the confirmation job's step
  time per kind, the speedup over each, a search strategy's lead the confirmation did not
  resolve (so a rival won) and the runoff job that measured it again, the Kendall tau of the trials' ranking against the
  confirmation job's (over every strategy in both, and over the pairs the confirmation's repeats
  resolve beyond its noise), each confirmation repeat's median step time, every trial (round,
  job, kind, predicted, measured and job-normalized step time), every trial job's level and
  drift, whether the time limit stopped the rounds short of the trial budget, and the wall time of each
  phase;
- ``report.md``: the same as tables;
- ``report.png``: predicted vs measured per trial, and the best step time so far against
  trials measured, with the best fair rival's line.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from hybridsync.autotune.result import TAU_TARGET, AutotuneResult, lead_text, rival_rule, runoff_text
from hybridsync.model.evaluate import describe_live, live_accuracy
from hybridsync.trials.store import cluster_label


def to_dict(result: AutotuneResult) -> dict[str, Any]:
    """The report as a JSON-ready document."""
    best, runner_up = result.best_rival, result.runner_up_rival
    return {
        "model": result.model, "cluster": result.cluster.to_dict(), "cluster_label": cluster_label(result.cluster.to_dict()),
        "exact": result.exact,
        "winner": {"kind": result.winner_kind, "step_s": result.confirmed_s[result.winner_kind],
                   "levers": sorted(result.winner_levers), "strategy": result.winner.to_dict()},
        "best_rival": None if best is None else {"kind": best[0], "step_s": best[1]},
        "speedup_over_best_rival": result.speedup,
        "runner_up_rival": None if runner_up is None else {"kind": runner_up[0], "step_s": runner_up[1]},
        "unresolved_lead": result.unresolved_lead,
        "runoff": result.runoff,
        "rivals_only": result.rivals_only,
        "rounds_cut": result.rounds_cut,
        "not_runnable": dict(result.not_runnable),
        "speedups": {kind: result.speedup_over(kind) for kind in sorted(result.confirmed_s)},
        "confirmed_s": dict(sorted(result.confirmed_s.items(), key=lambda item: item[1])),
        "trial_s": dict(sorted(result.trial_s.items(), key=lambda item: item[1])),
        "kendall_tau": {"tau": result.kendall_tau, "strategies": len(set(result.trial_s) & set(result.confirmed_s)),
                        "target": TAU_TARGET, "resolved_tau": result.resolved_tau,
                        "resolved_pairs": len(result.resolved_pairs())},
        "confirmed_repeats_s": result.confirmed_repeats_s,
        "trials": [dataclasses.asdict(t) for t in result.trials],
        "job_levels": result.job_levels,
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
    winner, best = doc["winner"], doc["best_rival"]
    lines = [f"# Autotune: {doc['model']} on {doc['cluster_label']}{' (exact)' if doc['exact'] else ''}", ""]
    lines.append(f"Winner: **{winner['kind']}**, {winner['step_s'] * 1e3:.1f} ms per step in the confirmation job"
                 f" (levers: {', '.join(winner['levers']) or 'none'}).")
    if best is not None:
        lines.append(f"Best fair rival: {best['kind']}, {best['step_s'] * 1e3:.1f} ms: the winner is "
                     f"**{doc['speedup_over_best_rival']:.2f}x** as fast ({rival_rule(doc)}).")
    runner_up = doc.get("runner_up_rival")
    if runner_up is not None and runner_up != best:  # a rival won: it is its own best rival, so name the next
        lines.append(f"Next fair rival: {runner_up['kind']}, {runner_up['step_s'] * 1e3:.1f} ms: the winner is "
                     f"**{runner_up['step_s'] / winner['step_s']:.2f}x** as fast.")
    if doc.get("unresolved_lead"):
        lines.append(f"Not taken: {lead_text(doc['unresolved_lead'])} (a search strategy replaces a hand-made "
                     "one only on a lead the confirmation job resolves, or a runoff job confirms).")
    if doc.get("runoff"):
        lines.append(f"Runoff: {runoff_text(doc['runoff'])}.")
    if doc.get("rivals_only"):
        lines.append(f"Budget: {doc['rivals_only']}.")
    if doc.get("rounds_cut"):
        cut = doc["rounds_cut"]
        lines.append(f"Time limit: the rounds stopped at {cut['measured']} of {cut['budget']} strategies "
                     f"({cut['why']}).")
    for kind, reason in doc["not_runnable"].items():
        lines.append(f"Not runnable on this model: {kind}: {reason}.")
    tau = doc["kendall_tau"]
    lines.append("Trials vs confirmation: " + ("too few strategies in both for a Kendall tau" if tau["tau"] is None
                 else f"Kendall tau **{tau['tau']:.2f}** over {tau['strategies']} strategies (target >= "
                      f"{tau['target']})") + "; " + resolved_tau_text(tau) + ".")
    seconds = doc["seconds"]
    lines += ["", describe_live(doc.get("simulator_accuracy"))]
    lines += ["", "Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()), "",
              "## Confirmation job (one job, interleaved repeats)", "",
              "| kind | ms per step | trials' ms (normalized) | winner's speedup |", "| --- | ---: | ---: | ---: |"]
    for kind, step_s in doc["confirmed_s"].items():
        trial = doc["trial_s"].get(kind)
        lines.append(f"| {kind} | {step_s * 1e3:.1f} | {'-' if trial is None else f'{trial * 1e3:.1f}'} | "
                     f"{doc['speedups'][kind]:.2f}x |")
    lines += ["", "## Trial jobs", "", "| job | trials | level | drift per minute |", "| --- | ---: | ---: | ---: |"]
    for job, level in doc["job_levels"].items():
        lines.append(f"| {job} | {level['trials']} | {level['level']:.3f} | {level['drift_per_min']:+.3f} |")
    lines += ["", "## Trials", "", "| # | round | job | kind | predicted ms | measured ms | normalized ms |",
              "| ---: | ---: | --- | --- | ---: | ---: | ---: |"]
    for i, trial in enumerate(doc["trials"], 1):
        measured = "failed" if trial["measured_s"] is None else f"{trial['measured_s'] * 1e3:.1f}"
        normalized = "-" if trial["normalized_s"] is None else f"{trial['normalized_s'] * 1e3:.1f}"
        predicted = "-" if trial["predicted_s"] is None else f"{trial['predicted_s'] * 1e3:.1f}"
        lines.append(f"| {i} | {trial['round']} | {trial['job'] or '-'} | {trial['kind']} | {predicted} | {measured} | "
                     f"{normalized} |")
    return "\n".join(lines) + "\n"


def resolved_tau_text(tau: dict[str, Any]) -> str:
    """The tau over the pairs the confirmation job resolves, said plainly (``AutotuneResult.resolved_tau``)."""
    if tau.get("resolved_tau") is None:
        return "the confirmation's repeats resolve no pair of them beyond its noise"
    return (f"over the {tau['resolved_pairs']} pairs its repeats resolve beyond its noise, tau "
            f"**{tau['resolved_tau']:.2f}**")


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
    right.plot(range(1, len(best) + 1), best, drawstyle="steps-post", label="best measured so far (normalized)")
    if doc["best_rival"] is not None:
        right.axhline(doc["best_rival"]["step_s"] * 1e3, color="tab:orange", linestyle="--",
                      label=f"best fair rival (confirmed): {doc['best_rival']['kind']}")
    right.axhline(doc["winner"]["step_s"] * 1e3, color="tab:green", linestyle=":", label="winner (confirmed)")
    right.set(xlabel="trials measured", ylabel="ms per step", title="best so far")
    right.legend(fontsize=8)
    figure.suptitle(f"autotune: {doc['model']} on {doc['cluster_label']}")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
