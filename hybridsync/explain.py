"""``hybridsync explain``: what a strategy does to each variable, as a table and totals per route."""
from __future__ import annotations

from typing import Mapping

from hybridsync.router.plan import build_plan
from hybridsync.strategy import Strategy, VarConfig
from hybridsync.variables import VariableInfo

_BAR_WIDTH = 20


def _how(config: VarConfig) -> str:
    return config.variant + (f"(s={config.staleness})" if config.staleness is not None else "")


def _human(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError


def explain(strategy: Strategy, variables: Mapping[str, VariableInfo] | None = None) -> str:
    """A per-variable table (route, how, shards, group, compression, bytes) and totals per route.

    Without ``variables`` only the listed variables and the default are shown, and bytes
    are unknown; with them the strategy is validated and every variable appears.
    """
    header = f"{'variable':<32} {'route':<9} {'how':<12} {'shards':>6} {'group':>5} {'compr':<5} {'bytes':>10}"
    lines = [f"strategy {strategy.fingerprint()}", header, "-" * len(header)]
    if variables is None:
        for name, config in sorted(strategy.variables.items()):
            lines.append(_row(name, config, None, 0))
        lines.append(_row("(default)", strategy.default, None, 0))
        return "\n".join(lines)
    plan = build_plan(variables, strategy)
    largest = max((v.nbytes for v in variables.values()), default=1) or 1
    totals: dict[str, list[int]] = {}
    for name, info in variables.items():
        config = strategy.config_for(name)
        lines.append(_row(name, config, info.nbytes, info.nbytes / largest))
        total = totals.setdefault(config.route, [0, 0, 0])
        total[0] += 1
        total[1] += info.nbytes
    for message in plan.messages:
        totals[message.config.route][2] += 1
    lines += ["", "per route:"]
    for route, (count, nbytes, messages) in sorted(totals.items()):
        lines.append(f"  {route:<9} {count:>4} variables  {messages:>4} messages  {_human(nbytes):>10}")
    return "\n".join(lines)


def _row(name: str, config: VarConfig, nbytes: int | None, share: float) -> str:
    shown = name if len(name) <= 32 else "..." + name[-29:]
    size = _human(nbytes) if nbytes is not None else "?"
    bar = "#" * max(1, round(share * _BAR_WIDTH)) if nbytes else ""
    group = "-" if config.group is None else str(config.group)
    return (f"{shown:<32} {config.route:<9} {_how(config):<12} {config.partitions:>6} {group:>5} "
            f"{config.compression or '-':<5} {size:>10} {bar}")
