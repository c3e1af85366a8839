"""The strategy's knobs: one table that every reader of a variable's config reads.

A knob is one key of a variable's config in a strategy file, and the ``VarConfig`` field of
the same name. What a knob is called, what values it takes, on which routes it applies, its
default, how the strategy space draws it and how ``hybridsync explain`` shows it are said
here once, and read by:

- the validator (``config_errors``, for a strategy document and a constructed ``VarConfig``
  alike) and the canonical document form (``strategy.py``);
- the strategy space's sampler and repair (``hybridsync/strategy_space/``) and the search's
  mutations (``search/operators.py``), through ``draw`` and the choices;
- the array form of strategies (``StrategyBatch``: a choice's code is its index in
  ``choices``) that the simulator's encoding (``model/encoding.py``) builds;
- ``hybridsync explain``'s per-variable table (``column``, ``text``).

Adding a knob is one entry here, a ``VarConfig`` field of the same name, and the code that
implements it (router or backend, the simulator's cost of it, its draw and mutation).
Pure data: no numpy, no torch.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Literal, Mapping

ROUTE_NAMES: tuple[str, ...] = ("allreduce", "ps")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Knob:
    """One key of a variable's config."""

    name: str
    """The key in strategy files, and the ``VarConfig`` field."""
    kind: Literal["choice", "integer", "per_shard", "flag"]
    """``choice``: one of ``choices``; ``integer``: an int >= ``minimum``; ``per_shard``: a list of
    ints >= ``minimum``, one per partition; ``flag``: ``true`` or ``false``."""
    doc: str
    """What it says, in a line: the README's table and the validator's hints repeat it."""
    routes: tuple[str, ...] = ROUTE_NAMES
    """The routes it applies to; on the others it keeps its default and a document may not name it."""
    default: Any = None
    choices: tuple[str, ...] = ()
    minimum: int = 0
    optional: bool = False
    """``None`` is a value (the default, absent from the document)."""
    only_with: tuple[str, str] | None = None
    """``(knob, value)``: it applies only when that knob has that value, and must then be given."""
    variant: bool = False
    """It says how its route runs (``VarConfig.variant``): always written in the canonical document."""
    merged_alike: bool = False
    """Variables merged into one message (one ``group``) must agree on it (``VarConfig.message_key``)."""
    item: str = "value"
    """``per_shard``: what one entry is, for error messages."""
    draw: tuple[Any, ...] = ()
    """What the strategy space draws it from; the entry's comment says how it is read."""
    column: str | None = None
    """``hybridsync explain``'s column that shows it (knobs of one column are shown together)."""
    text: Callable[[Any], str] = str
    """How ``explain`` shows a value."""
    rule: Callable[[Mapping[str, Any]], str | None] | None = None
    """Given every knob's value, why this knob's (not its default) cannot be set there, or ``None``
    where it can: a constraint on the other knobs that ``only_with`` cannot say."""

    def applies(self, values: Mapping[str, Any]) -> bool:
        """Whether the knob means something in a config whose knobs have ``values``."""
        if values["route"] not in self.routes:
            return False
        return self.only_with is None or values[self.only_with[0]] == self.only_with[1]

    def code(self, value: str) -> int:
        """A choice's code in the array form of strategies: its index in ``choices``."""
        return self.choices.index(value)

    def value_errors(self, value: Any, partitions: Any) -> list[str]:
        """What is wrong with ``value`` on its own (``partitions``: for a ``per_shard`` knob)."""
        if value is None and self.optional:
            return []
        if self.kind == "choice":
            return [] if value in self.choices else [f"{self.name} {value!r} is not one of {', '.join(self.choices)}"]
        if self.kind == "flag":
            return [] if isinstance(value, bool) else [f"{self.name} must be true or false, got {value!r}"]
        if self.kind == "integer":
            return [] if _is_int(value) and value >= self.minimum else \
                [f"{self.name} must be an integer >= {self.minimum}, got {value!r}"]
        if not isinstance(value, (list, tuple)) or not all(_is_int(v) and v >= self.minimum for v in value):
            return [f"{self.name} must list one {self.item} per shard (integers >= {self.minimum}), got {value!r}"]
        if _is_int(partitions) and len(value) != partitions:
            return [f"{self.name} lists {len(value)} {self.item}s but partitions is {partitions}"]
        return []


# The draws (``Knob.draw``) as the strategy space reads them: route: the Dirichlet concentration of
# the strategy's route weights; partitions: the partition sizes in bytes a strategy splits its
# variables by (None: never split); group: the merge groups per message kind (0: none);
# compression: the share of a strategy's floating variables on the last choice (fp16); protocol:
# each choice's probability for a strategy's PS variables; staleness: the SSP stalenesses;
# servers: the share of strategies that place their PS shards explicitly.
ROUTE = Knob(name="route", kind="choice", doc="`allreduce` (Horovod collectives) or `ps` (parameter servers)",
             default="allreduce", choices=ROUTE_NAMES, merged_alike=True, draw=(0.6,), column="route")
ALGORITHM = Knob(name="algorithm", kind="choice", doc="`ring` (Horovod) or `hierarchical` (intra-node first)",
                 routes=("allreduce",), default="ring", choices=("ring", "hierarchical"), variant=True,
                 merged_alike=True, column="how")
PROTOCOL = Knob(name="protocol", kind="choice", doc="`bsp`, `asp` or `ssp`: the parameter servers' consistency",
                routes=("ps",), default="bsp", choices=("bsp", "asp", "ssp"), variant=True, merged_alike=True,
                draw=(0.7, 0.15, 0.15), column="how")
STALENESS = Knob(name="staleness", kind="integer", doc="steps a worker may run ahead of the slowest one",
                 routes=("ps",), optional=True, only_with=("protocol", "ssp"), merged_alike=True, draw=(1, 2, 3),
                 column="how", text=lambda staleness: f"(s={staleness})")
SERVERS = Knob(name="servers", kind="per_shard", doc="the server index of each shard; absent balances shards by bytes",
               routes=("ps",), optional=True, item="placement", draw=(0.3,), column="servers",
               text=lambda servers: ",".join(str(s) for s in servers))
PARTITIONS = Knob(name="partitions", kind="integer", doc="split along dim 0 into this many near-equal shards, "
                  "one message each", default=1, minimum=1, draw=(None, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024),
                  column="shards")
GROUP = Knob(name="group", kind="integer", doc="variables sharing a group have their k-th shards fused into one "
             "message", optional=True, draw=(0, 1, 2, 4, 8), column="group")
COMPRESSION = Knob(name="compression", kind="choice", doc="wire compression; absent: the optimizer's `compression=`",
                   optional=True, choices=("none", "fp16"), merged_alike=True, draw=(0.0, 0.0, 0.5, 1.0),
                   column="compr")


def _rows_rule(values: Mapping[str, Any]) -> str | None:
    """Where a dense gradient can travel as its nonzero rows (as a sparse gradient does)."""
    if values["compression"] == "fp16":
        return "rows sends the rows' values uncompressed: compression 'fp16' is not supported with it"
    if values["route"] == "ps":
        return None if values["protocol"] == "bsp" else \
            f"rows needs protocol 'bsp' on the parameter servers (asp/ssp exchange parameters), got {values['protocol']!r}"
    if values["algorithm"] != "ring" or values["partitions"] != 1 or values["group"] is not None:
        return (f"rows on the all-reduce route travels as Horovod's sparse all-gather: algorithm 'ring', one "
                f"message of its own (partitions 1, no group); got algorithm {values['algorithm']!r}, partitions "
                f"{values['partitions']}, group {values['group']}")
    return None


ROWS = Knob(name="rows", kind="flag", doc="the dense gradient travels as its nonzero rows (indices and values, "
            "as a sparse gradient does): `ps` with `bsp`, or `allreduce` `ring` alone (no group, partitions 1)",
            default=False, rule=_rows_rule, column="rows", text=lambda rows: "rows" if rows else "")

KNOBS: tuple[Knob, ...] = (ROUTE, ALGORITHM, PROTOCOL, STALENESS, PARTITIONS, SERVERS, GROUP, COMPRESSION, ROWS)
"""Every knob, in the canonical document's key order."""
BY_NAME: dict[str, Knob] = {knob.name: knob for knob in KNOBS}


def keys_for(route: str) -> tuple[str, ...]:
    """The keys a config on ``route`` may have."""
    return tuple(knob.name for knob in KNOBS if route in knob.routes)


def _key_hint(key: str, route: str) -> str:
    """What a key the route does not take most likely meant: another route's key (``algorithm`` on the
    PS route), or a near spelling of one of the route's own (``partitons``)."""
    knob = BY_NAME.get(key)
    if knob is not None:
        return f"; {key!r} is a key of route {' and '.join(knob.routes)}"
    close = difflib.get_close_matches(str(key), sorted(keys_for(route)), n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


def config_errors(given: Mapping[str, Any]) -> list[str]:
    """Every problem with one variable's config, one message each.

    ``given`` holds the config's keys as a document has them (absent: the default); a
    ``VarConfig`` gives its route and every field that differs from its default, so that a
    field that does not apply to the route must keep its default.
    """
    route = given.get("route", ROUTE.default)
    if route not in ROUTE.choices:
        return [f"route {route!r} is not one of {', '.join(ROUTE.choices)}"]
    values = {knob.name: given.get(knob.name, knob.default) for knob in KNOBS}
    errors = []
    for key, value in given.items():
        knob = BY_NAME.get(key)
        if knob is None or route not in knob.routes:
            errors.append(f"unknown key {key!r} for route {route!r} (allowed: {', '.join(sorted(keys_for(route)))})"
                          + _key_hint(key, route))
        elif key != "route":
            errors += knob.value_errors(value, values["partitions"])
    for knob in KNOBS:
        if knob.only_with is None or route not in knob.routes:
            continue
        other, needed = knob.only_with
        if knob.applies(values) and values[knob.name] is None:
            errors.append(f"{other} {needed!r} needs a {knob.name!r} ({knob.doc})")
        elif not knob.applies(values) and values[knob.name] is not None:
            errors.append(f"{knob.name!r} only applies to {other} {needed!r}")
    for knob in KNOBS:
        if knob.rule is not None and route in knob.routes and differs(values[knob.name], knob.default):
            why = knob.rule(values)
            if why is not None:
                errors.append(why)
    return errors


def differs(value: Any, default: Any) -> bool:
    """Whether a field's value is not its default (``True`` is not the default ``1``)."""
    return type(value) is not type(default) or value != default


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
