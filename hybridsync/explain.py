"""``hybridsync explain``: what a strategy does to each variable, as a table and totals per route.

The table has a column per ``column`` of the knobs (``hybridsync.knobs``): a new knob shows up
here by its entry alone.
"""
from __future__ import annotations

from typing import Mapping

from hybridsync import knobs
from hybridsync.description import VariableInfo
from hybridsync.router.plan import RoutingPlan, build_plan
from hybridsync.strategy import Strategy, VarConfig

_NAME_WIDTH = 32
_BAR_WIDTH = 20
_RIGHT = ({knob.column for knob in knobs.KNOBS if knob.kind == "integer"}
          - {knob.column for knob in knobs.KNOBS if knob.kind != "integer"})
"""Columns of numbers only, aligned right."""


def explain(strategy: Strategy, variables: Mapping[str, VariableInfo] | None = None) -> str:
    """A per-variable table (each knob's column, bytes) and totals per route.

    Without ``variables`` only the listed variables and the default are shown, and bytes
    are unknown; with them the strategy is validated and every variable appears.
    """
    if variables is None:
        rows = [(name, config, None) for name, config in sorted(strategy.variables.items())]
        rows.append(("(default)", strategy.default, None))
        return "\n".join([f"strategy {strategy.fingerprint()}", *_table(rows, largest=1)])
    plan = build_plan(variables, strategy)
    rows = [(name, strategy.config_for(name), info.nbytes) for name, info in variables.items()]
    lines = [f"strategy {strategy.fingerprint()}",
             *_table(rows, largest=max((v.nbytes for v in variables.values()), default=1) or 1)]
    totals: dict[str, list[int]] = {}
    for _, config, nbytes in rows:
        total = totals.setdefault(config.route, [0, 0, 0])
        total[0] += 1
        total[1] += nbytes
    for message in plan.messages:
        totals[message.config.route][2] += 1
    lines += ["", "per route:"]
    for route, (count, nbytes, messages) in sorted(totals.items()):
        lines.append(f"  {route:<9} {count:>4} variables  {messages:>4} messages  {_human(nbytes):>10}")
    dense = sent_dense(plan)
    if dense:
        lines += ["", f"sparse gradients sent at their full dense size: {', '.join(dense)}",
                  "  (on the all-reduce route a sparse gradient travels as the rows a step touched only whole and",
                  "  alone on the ring; partitioned, merged or hierarchical it is made dense; the parameter",
                  "  servers take its rows in any shape)"]
    return "\n".join(lines)


def sent_dense(plan: RoutingPlan) -> list[str]:
    """The sparse variables ``plan`` sends at their full dense size: on the all-reduce route only a
    whole variable alone in its message on the ring goes as Horovod's all-gather of touched rows;
    partitioned, merged or hierarchical, the router makes it dense (``hybridsync.router.runtime``).
    A strategy can cost a model many times its step this way without a word from the job."""
    names = {piece.var_name for message in plan.messages if message.config.route == "allreduce"
             and not (len(message.pieces) == 1 and message.pieces[0].whole and message.config.algorithm == "ring")
             for piece in message.pieces if piece.sparse and not piece.rows}
    return sorted(names)


def _table(rows: list[tuple[str, VarConfig, int | None]], largest: int) -> list[str]:
    """Header, rule and one line per ``(name, config, bytes or None)``, columns as wide as their cells."""
    cells = [_cells(config) for _, config, _ in rows]
    columns = list(cells[0])
    widths = {c: max(len(c), *(len(row[c]) for row in cells)) for c in columns}
    header = f"{'variable':<{_NAME_WIDTH}} " + " ".join(_aligned(c, c, widths) for c in columns) + f" {'bytes':>10}"
    lines = [header, "-" * len(header)]
    for (name, _, nbytes), row in zip(rows, cells):
        shown = name if len(name) <= _NAME_WIDTH else "..." + name[-(_NAME_WIDTH - 3):]
        size = _human(nbytes) if nbytes is not None else "?"
        bar = "#" * max(1, round(nbytes / largest * _BAR_WIDTH)) if nbytes else ""
        lines.append(f"{shown:<{_NAME_WIDTH}} " + " ".join(_aligned(row[c], c, widths) for c in columns)
                     + f" {size:>10} {bar}")
    return lines


def _cells(config: VarConfig) -> dict[str, str]:
    """Column -> text of ``config``: the knobs that apply and are set ("-" for none)."""
    values = {knob.name: getattr(config, knob.name) for knob in knobs.KNOBS}
    cells: dict[str, str] = {}
    for knob in knobs.KNOBS:
        if knob.column is not None:
            value = values[knob.name]
            shown = knob.text(value) if value is not None and knob.applies(values) else ""
            cells[knob.column] = cells.get(knob.column, "") + shown
    return {column: text or "-" for column, text in cells.items()}


def _aligned(text: str, column: str, widths: dict[str, int]) -> str:
    return f"{text:>{widths[column]}}" if column in _RIGHT else f"{text:<{widths[column]}}"


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError
