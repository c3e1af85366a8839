"""The ``Strategy`` value object: how each variable's gradient is synchronized.

A strategy is what the search produces and what a user can write by hand. It is a
plain, versioned document (JSON or YAML) of this shape::

    {"version": 1,
     "default": {"route": "allreduce", "algorithm": "ring"},
     "variables": {
       "emb.weight": {"route": "ps", "partitions": 4, "protocol": "bsp"},
       "fc1.weight": {"route": "allreduce", "partitions": 2, "group": 1, "compression": "fp16"},
       "fc1.bias":   {"route": "allreduce", "group": 1}},
     "sync": {"policy": "switch", "switch_at": 0.25, "total_steps": 400}}

``sync`` (optional) is the Sync-Switch policy of the PS-routed variables: ``static`` (each
keeps its ``protocol``), ``switch`` (BSP first, then ASP) or ``elastic`` (ASP while a
straggler lasts); see ``hybridsync/sync_policy.py`` for its keys. The keys of a variable's
config are the knobs of ``hybridsync/knobs.py``, whose one validator checks documents and
``VarConfig`` objects alike.

Every user mistake is reported at once, as a ``ValueError`` that names every culprit,
so a bad file fails before the first step instead of half-way through training.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
from typing import Any, Iterable, Literal, Mapping

from hybridsync import envvars, knobs
from hybridsync.description import FLOATING_DTYPES, VariableInfo
from hybridsync.sync_policy import SyncPolicy, policy_errors

STRATEGY_VERSION = 1
Route = Literal["allreduce", "ps"]
Algorithm = Literal["ring", "hierarchical"]
CompressionName = Literal["none", "fp16"]
Protocol = Literal["bsp", "asp", "ssp"]

TOP_LEVEL_KEYS = {"version", "default", "variables", "sync"}
"""The keys a strategy document may have at its top level (the docs name each: tests/test_docs.py)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class VarConfig:
    """How one variable's gradient travels: one field per knob of ``hybridsync.knobs`` (which says
    what each means, where it applies and what it takes), defaults from there."""

    route: Route = knobs.ROUTE.default
    algorithm: Algorithm = knobs.ALGORITHM.default
    protocol: Protocol = knobs.PROTOCOL.default
    staleness: int | None = knobs.STALENESS.default
    partitions: int = knobs.PARTITIONS.default
    servers: tuple[int, ...] | None = knobs.SERVERS.default
    group: int | None = knobs.GROUP.default
    compression: CompressionName | None = knobs.COMPRESSION.default
    """``None``: the optimizer's ``compression=`` argument decides."""
    rows: bool = knobs.ROWS.default
    """The dense gradient travels as its nonzero rows, as a sparse gradient would (``validate_for``:
    dense floating variables only); the optimizer's ``compression=`` does not apply to the rows."""

    def __post_init__(self) -> None:
        """Reject a config that no strategy file could express: ``ValueError`` naming the field.

        Fields that do not apply to the route must keep their defaults, so that two configs
        are equal exactly when their documents are (a search can key sets by them).
        """
        if isinstance(self.servers, list):
            object.__setattr__(self, "servers", tuple(self.servers))
        given = {knob.name: getattr(self, knob.name) for knob in knobs.KNOBS
                 if knob is knobs.ROUTE or knobs.differs(getattr(self, knob.name), knob.default)}
        errors = knobs.config_errors(given)
        if errors:
            raise ValueError("invalid VarConfig: " + "; ".join(errors))

    @property
    def variant(self) -> str:
        """How the route runs: the all-reduce ``algorithm``, or the parameter-server ``protocol``."""
        return self.algorithm if self.route == "allreduce" else self.protocol

    @property
    def hierarchical(self) -> bool:
        """Whether the gradient goes by hierarchical all-reduce."""
        return self.route == "allreduce" and self.algorithm == "hierarchical"

    @property
    def route_name(self) -> str:
        """``route/variant``, as messages and tables show it (``allreduce/ring``, ``ps/asp``)."""
        return f"{self.route}/{self.variant}"

    def to_dict(self) -> dict[str, Any]:
        """The canonical document form: only the keys meaningful for the route, defaults omitted
        (the route and its variant always written), in ``knobs.KNOBS`` order."""
        out: dict[str, Any] = {}
        for knob in knobs.KNOBS:
            value = getattr(self, knob.name)
            if self.route in knob.routes and (knob is knobs.ROUTE or knob.variant or value != knob.default):
                out[knob.name] = list(value) if knob.kind == "per_shard" else value
        return out

    @property
    def message_key(self) -> tuple:
        """What two variables must share to be fused into one message (``Knob.merged_alike``, and the group)."""
        return tuple(getattr(self, knob.name) for knob in _MERGED_ALIKE) + (self.group,)


_MERGED_ALIKE = tuple(knob for knob in knobs.KNOBS if knob.merged_alike)
assert [f.name for f in dataclasses.fields(VarConfig)] == [knob.name for knob in knobs.KNOBS]


def _sync_protocol_errors(sync: SyncPolicy, default: VarConfig, variables: Mapping[str, VarConfig]) -> list[str]:
    """A dynamic policy starts every PS variable in BSP and switches them all together."""
    configs = [("default", default), *((f"variable {name!r}", c) for name, c in variables.items())]
    errors = [f"{where}: protocol {config.protocol!r} conflicts with sync.policy {sync.policy!r} (the policy "
              f"starts every PS-routed variable in 'bsp' and switches them together; use policy 'static' "
              f"for per-variable protocols)" for where, config in configs
              if config.route == "ps" and config.protocol != "bsp"]
    if not any(config.route == "ps" for _, config in configs):
        errors.append(f"sync.policy {sync.policy!r} needs PS-routed variables (route 'ps'); this strategy has none")
    return errors


def _raise_if(errors: list[str]) -> None:
    if errors:
        raise ValueError("invalid strategy:\n  - " + "\n  - ".join(errors))


def _config_errors(where: str, raw: Any) -> list[str]:
    """Every problem with one variable's (or the default's) config in a document, as messages."""
    if not isinstance(raw, Mapping):
        return [f"{where}: expected a mapping, got {type(raw).__name__}"]
    return [f"{where}: {error}" for error in knobs.config_errors(raw)]


class _ReadOnlyDict(dict):
    """A dict that refuses changes (and still pickles, JSON-dumps and compares as a dict)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a Strategy's variables are read-only: make a new Strategy (e.g. dataclasses.replace)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse  # type: ignore

    def __reduce__(self) -> tuple:
        return (type(self), (dict(self),))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """Per-variable synchronization configs, with a default for unlisted variables."""

    default: VarConfig = VarConfig()
    """Applies to every variable not listed in ``variables``."""
    variables: Mapping[str, VarConfig] = dataclasses.field(default_factory=dict)
    """Variable name (as in ``named_parameters``) -> its config (kept as a read-only copy)."""
    sync: SyncPolicy | None = None
    """Sync-Switch policy of the PS-routed variables; ``None`` (or ``static``): their own protocols."""

    def __post_init__(self) -> None:
        if not isinstance(self.default, VarConfig):
            raise ValueError(f"default must be a VarConfig, got {type(self.default).__name__}")
        if self.sync is not None and not isinstance(self.sync, SyncPolicy):
            raise ValueError(f"sync must be a SyncPolicy, got {type(self.sync).__name__}")
        bad = sorted(str(name) for name, config in self.variables.items() if not isinstance(config, VarConfig))
        if bad:
            raise ValueError(f"variables must map names to VarConfig; not one: {', '.join(bad)}")
        if self.sync is not None and self.sync.dynamic:
            _raise_if(_sync_protocol_errors(self.sync, self.default, self.variables))
        # A read-only copy: the strategy is a value (hashable, below), so it must not change after the fact.
        object.__setattr__(self, "variables", _ReadOnlyDict(self.variables))

    def __hash__(self) -> int:
        """Strategies key sets and dicts; equal strategies have equal documents, hence equal fingerprints."""
        return hash(self.fingerprint())

    @property
    def uses_ps(self) -> bool:
        """Whether the default or any variable goes by the parameter-server route: a job with this
        strategy needs servers exactly then."""
        return any(config.route == "ps" for config in (self.default, *self.variables.values()))

    @property
    def uses_hierarchical(self) -> bool:
        """Whether the default or any variable goes by hierarchical all-reduce: a job with this
        strategy needs nodes holding equal numbers of ranks exactly then."""
        return self.default.hierarchical or bool(self.hierarchical_variables())

    def servers_beyond(self, num_servers: int) -> dict[str, list[int]]:
        """The configs (by variable name, ``"default"`` for the default) that pin a shard to a
        parameter server a job of ``num_servers`` servers (numbered from 0) does not have, with those
        server indices; empty when the strategy fits such a job."""
        configs = {"default": self.default, **self.variables}
        beyond = {name: [s for s in config.servers if s >= num_servers]
                  for name, config in configs.items() if config.route == "ps" and config.servers}
        return {name: servers for name, servers in beyond.items() if servers}

    def hierarchical_variables(self) -> list[str]:
        """The variables this strategy names that go by hierarchical all-reduce."""
        return [name for name, config in self.variables.items() if config.hierarchical]

    def config_for(self, name: str) -> VarConfig:
        """The config that applies to the variable ``name``."""
        return self.variables.get(name, self.default)

    # --- document round trip -------------------------------------------------------
    @classmethod
    def from_dict(cls, doc: Any) -> "Strategy":
        """Parse and validate a strategy document; raises ``ValueError`` naming every culprit."""
        if not isinstance(doc, Mapping):
            raise ValueError(f"invalid strategy: expected a mapping at top level, got {type(doc).__name__}")
        errors = [f"unknown top-level key {key!r} (allowed: {', '.join(sorted(TOP_LEVEL_KEYS))})"
                  for key in doc if key not in TOP_LEVEL_KEYS]
        version = doc.get("version", STRATEGY_VERSION)
        if type(version) is not int or version != STRATEGY_VERSION:  # True and 1.0 equal 1 in Python
            errors.append(f"version {doc.get('version')!r} is not supported (this hybridsync reads "
                          f"version {STRATEGY_VERSION})")
        default_raw = doc.get("default", {})
        errors += _config_errors("default", default_raw)
        variables_raw = doc.get("variables", {})
        if not isinstance(variables_raw, Mapping):
            errors.append(f"variables: expected a mapping of name -> config, got "
                          f"{type(variables_raw).__name__}")
            variables_raw = {}
        for name, raw in variables_raw.items():
            errors += _config_errors(f"variable {name!r}", raw)
        if "sync" in doc:
            errors += policy_errors(doc["sync"])
        _raise_if(errors)
        return cls(default=VarConfig(**default_raw),
                   variables={name: VarConfig(**raw) for name, raw in variables_raw.items()},
                   sync=SyncPolicy.from_dict(doc["sync"]) if "sync" in doc else None)

    def to_dict(self) -> dict[str, Any]:
        """The canonical document (sorted variables, defaults omitted)."""
        doc = {"version": STRATEGY_VERSION, "default": self.default.to_dict(),
               "variables": {name: self.variables[name].to_dict() for name in sorted(self.variables)}}
        if self.sync is not None and self.sync.dynamic:  # static is what no section means
            doc["sync"] = self.sync.to_dict()
        return doc

    def with_ring_for_hierarchical(self) -> "Strategy":
        """This strategy with every hierarchical all-reduce (the default's too) made a ring all-reduce,
        nothing else changed: what runs with one rank per node, where ``backends.make_backend`` sends
        the route the ring's way."""
        def ring(config: VarConfig) -> VarConfig:
            return dataclasses.replace(config, algorithm="ring") if config.hierarchical else config
        return dataclasses.replace(self, default=ring(self.default),
                                   variables={n: ring(c) for n, c in self.variables.items()})

    def with_ps_protocol(self, protocol: Protocol) -> "Strategy":
        """This strategy with every PS-routed variable (and a PS default) on ``protocol``: the plan a
        Sync-Switch policy runs between switches; its ``sync`` section is dropped (the policy's
        controller applies such plans, it does not start another one)."""
        def swap(config: VarConfig) -> VarConfig:
            if config.route != "ps":
                return config
            # ASP/SSP exchange parameters, not gradients: rows (BSP only) has nothing to send there
            return dataclasses.replace(config, protocol=protocol, rows=config.rows and protocol == "bsp")
        return Strategy(default=swap(self.default), variables={n: swap(c) for n, c in self.variables.items()})

    def restricted_to(self, names: Iterable[str]) -> "Strategy":
        """The entries of ``names`` only: one optimizer's part of a strategy for the whole model (a
        script with a sparse and a dense optimizer gets one strategy for both). The default stays;
        a dynamic ``sync`` policy stays while a PS-routed variable (or a PS default) is left."""
        names = set(names)
        kept = {name: config for name, config in self.variables.items() if name in names}
        if len(kept) == len(self.variables):
            return self
        part = Strategy(default=self.default, variables=kept)
        return dataclasses.replace(part, sync=self.sync) if part.uses_ps else part

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Strategy":
        """Read a ``.json``, ``.yaml`` or ``.yml`` strategy file."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"cannot read strategy file {path!r}: {e.strerror}") from e
        except UnicodeDecodeError as e:
            raise ValueError(f"strategy file {path!r} is not valid: not UTF-8 text ({e.reason} at byte "
                             f"{e.start})") from e
        key = (_is_yaml(path), text)
        if cls is Strategy and key in _LOADED:
            _LOADED[key] = _LOADED.pop(key)  # the most recently read last: the oldest goes first
            return _LOADED[key]
        try:
            doc = _parse_document(path, text)
        except ValueError as e:
            raise ValueError(f"strategy file {path!r} is not valid: {e}") from e
        try:
            strategy = cls.from_dict(doc)
        except ValueError as e:
            raise ValueError(f"strategy file {path!r}: {e}") from e
        if cls is Strategy:
            _LOADED[key] = strategy
            while len(_LOADED) > _LOADED_KEPT:
                del _LOADED[next(iter(_LOADED))]
        return strategy

    def save(self, path: str | os.PathLike) -> None:
        """Write the canonical document; YAML if the name ends in .yaml/.yml, else JSON. The folder is
        made if missing: the work that chose the strategy (a search, trials) must not be lost to it."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            if _is_yaml(path):
                import yaml
                yaml.safe_dump(self.to_dict(), f, sort_keys=False)
            else:
                json.dump(self.to_dict(), f, indent=2)
                f.write("\n")

    def fingerprint(self) -> str:
        """A stable hash of the canonical document: equal strategies hash equally on every machine."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]

    # --- validation against a model --------------------------------------------------
    def validate_for(self, variables: Mapping[str, VariableInfo]) -> None:
        """Check the strategy against a model's variables; ``ValueError`` naming every culprit."""
        errors = unknown_variable_errors(self.variables, variables)
        for name, info in variables.items():
            errors += _fit_errors(name, info, self.config_for(name))
        errors += _group_errors(self, variables)
        if errors:
            raise ValueError("strategy does not fit the model:\n  - " + "\n  - ".join(errors))


def unknown_variable_errors(named: Iterable[str], known: Iterable[str]) -> list[str]:
    """One line per variable a strategy names (``named``) that the model lacks (``known`` are the
    model's names), with the name it most likely meant: a wrapper's prefix (``torch.compile``'s
    ``_orig_mod.``, ``DataParallel``'s ``module.``) or a near spelling. When the strategy names none of
    the model's variables and no line found a match, one more line shows the model's own names: the
    strategy was made for another model."""
    known, named = sorted(known), sorted(named)
    known_set = set(known)
    unknown = [name for name in named if name not in known_set]
    meant = {name: _meant(name, known) for name in unknown}
    errors = [f"variable {name!r} is not in the model" + (f"; did you mean {meant[name]!r}?" if meant[name] else "")
              for name in unknown]
    if known and unknown and unknown == named and not any(meant.values()):
        shown = ", ".join(known[:6]) + (f", ... ({len(known)} in all)" if len(known) > 6 else "")
        errors.append(f"the strategy names none of the model's variables ({shown}): is it for another model?")
    return errors


def _meant(name: str, known: list[str]) -> str | None:
    """The model's variable a strategy's unknown ``name`` most likely means, if any."""
    for other in known:  # the same name under a wrapper's prefix (a module's ".", a TensorFlow scope's "/")
        if any(other.endswith(sep + name) or name.endswith(sep + other) for sep in "./"):
            return other
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
    return close[0] if close else None


def _fit_errors(name: str, info: VariableInfo, config: VarConfig) -> list[str]:
    rows = info.shape[0] if info.shape else 1
    errors = []
    if config.partitions > max(rows, 1):  # a variable with no rows (shape (0, ...)) is one piece
        errors.append(f"variable {name!r}: partitions {config.partitions} exceeds its {rows} rows "
                      f"(shape {tuple(info.shape)})")
    if config.rows:
        errors += [f"variable {name!r}: rows {why}" for why in _rows_fit_errors(info)]
    return errors


def _rows_fit_errors(info: VariableInfo) -> list[str]:
    """Why a variable's gradient cannot travel as its nonzero rows (``VarConfig.rows``)."""
    if info.sparse:
        return ["is for dense gradients: this one is sparse already (it travels as rows without it)"]
    if info.dtype not in FLOATING_DTYPES:
        return [f"is for floating gradients, not {info.dtype}"]
    if not info.shape:
        return ["needs a gradient with rows (dim 0); this one is a scalar"]
    return []


def _group_errors(strategy: Strategy, variables: Mapping[str, VariableInfo]) -> list[str]:
    """Variables in one group must agree on everything that shapes the message."""
    keys_by_group: dict[int, dict[tuple, list[str]]] = {}
    for name in variables:
        config = strategy.config_for(name)
        if config.group is not None:
            keys_by_group.setdefault(config.group, {}).setdefault(config.message_key, []).append(name)
    return [f"group {group}: its variables disagree on route/algorithm/protocol/compression: "
            + "; ".join(", ".join(names) for names in by_key.values())
            for group, by_key in sorted(keys_by_group.items()) if len(by_key) > 1]


_LOADED_KEPT = 8
_LOADED: dict[tuple[bool, str], Strategy] = {}
"""The strategies last read from files, by (YAML?, text): a file read at every step (an eager
TensorFlow loop builds a tape per step, each resolving ``HYBRIDSYNC_STRATEGY``) is parsed and
validated once (~0.9 ms for 50 variables), and a changed file is read anew (strategies are values)."""


def _is_yaml(path: str) -> bool:
    """Strategy files are YAML by their name (``.yaml``, ``.yml``), else JSON."""
    return path.endswith((".yaml", ".yml"))


def _unique_keys(pairs: Iterable[tuple[Any, Any]]) -> dict[Any, Any]:
    """A mapping of parsed pairs that refuses a key given twice: JSON and YAML parsers keep the
    last silently, so a variable listed twice would be configured by one entry with no word."""
    mapping: dict[Any, Any] = {}
    for key, value in pairs:
        if key in mapping:
            raise ValueError(f"key {key!r} appears twice in one mapping; give each key once")
        mapping[key] = value
    return mapping


def _parse_document(path: str, text: str) -> Any:
    if _is_yaml(path):
        import yaml

        class UniqueKeyLoader(yaml.SafeLoader):
            def construct_mapping(self, node: Any, deep: bool = False) -> Any:
                _unique_keys((self.construct_object(key), None) for key, _ in node.value
                             if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge")
                return super().construct_mapping(node, deep=deep)

        try:
            return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
        except yaml.YAMLError as e:
            raise ValueError(str(e)) from e
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise ValueError(str(e)) from e


def resolve_strategy(strategy: "Strategy | Mapping[str, Any] | str | os.PathLike | None") -> Strategy | None:
    """Turn the optimizer's ``strategy=`` argument into a Strategy.

    ``None`` reads the path in ``HYBRIDSYNC_STRATEGY``; with neither, returns ``None``
    (plain Horovod behaviour: every variable ring all-reduced).
    """
    if strategy is None:
        strategy = os.environ.get(envvars.STRATEGY) or None
        if strategy is None:
            return None
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, Mapping):
        return Strategy.from_dict(strategy)
    if isinstance(strategy, (str, os.PathLike)):
        return Strategy.load(strategy)
    raise ValueError(f"strategy must be a Strategy, a dict or a path, got {type(strategy).__name__}")
