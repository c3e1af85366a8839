"""Model description files: a model's variables, plus the compute timing a profiler measured.

The simulator and the search never import the user's model; they read this file and a
cluster spec. Strategies are validated, builders run and the simulator reasons on its
``VariableInfo`` records, so all of them work from a description file on a laptop with no
framework and no cluster. This module is the one home of model descriptions: what one
variable is (``VariableInfo``, made from a torch model by ``variables_from_model``), the
plain description (variables only: ``load_model_description`` and its siblings, which read
any description and ignore its timing) and the profiled one (``ModelDescription``:
``load_description`` and its siblings), which adds what the profiler (``hybridsync
profile``) measures on one process: forward, backward and optimizer time per step, each gradient's
ready order and time within the backward pass, and rows touched per step (of sparse
gradients; of dense ones, the rows with a nonzero element when fewer than all). One variable per line, so descriptions diff well::

    {
     "version": 1,
     "name": "ncf",
     "timing": {"forward_s": 0.0121, "backward_s": 0.0203, "optimizer_s": 0.0034, "step_s": 0.0371,
                "steps": 10, "batch_size": 256},
     "meta": {"torch": "2.13.0+cpu", "hybridsync": "0.1.0", "host": "h", "date": "...", "command": "..."},
     "variables": [
      {"name": "emb.weight", "shape": [100000, 32], "dtype": "float32", "sparse": true,
       "ready_order": 5, "ready_s": 0.0189, "rows_touched": 243},
      {"name": "fc.weight", "shape": [1, 64], "dtype": "float32", "sparse": false,
       "ready_order": 0, "ready_s": 0.0004}
     ]
    }

Torch-free and numpy-free: the runtime and the simulator's side of the project import it
(``hybridsync.variables``, its old name for the variable records and the plain files, still works).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any, Iterable, Mapping

DESCRIPTION_VERSION = 1
_TOP_LEVEL_KEYS = ("version", "name", "timing", "meta", "variables")
_VARIABLE_KEYS = ("name", "shape", "dtype", "sparse", "ready_order", "ready_s", "rows_touched")
_TIMING_KEYS = ("forward_s", "backward_s", "optimizer_s", "step_s", "steps", "batch_size")


FLOATING_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz",
                             "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"})
"""What ``torch.dtype.is_floating_point`` says yes to: the dtypes fp16 compression casts."""
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
             "complex128": 16, "complex64": 8, "complex32": 4,
             **{name: 1 for name in FLOATING_DTYPES if name.startswith("float8")}}
DTYPES = frozenset(_ITEMSIZE)
"""Every dtype name a model description may give."""


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a name as ``VariableInfo.dtype`` spells it)."""
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(sorted(_ITEMSIZE))})") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class VariableInfo:
    """One trainable variable: its name, shape, element type and whether its gradient is sparse."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    """Element type name as torch/numpy spell it without prefix (``float32``, ``float16``...)."""
    sparse: bool = False
    """True for variables whose gradient touches a few rows (e.g. ``nn.Embedding(sparse=True)``)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


def variables_from_parameters(named_parameters: Iterable[tuple[str, Any]],
                              sparse_names: Iterable[str] = ()) -> dict[str, VariableInfo]:
    """``VariableInfo`` for each (name, torch parameter); ``sparse_names`` marks sparse gradients."""
    sparse = set(sparse_names)
    return {name: VariableInfo(name=name, shape=tuple(p.shape), dtype=str(p.dtype).removeprefix("torch."),
                               sparse=name in sparse)
            for name, p in named_parameters}


def variables_from_model(model: Any) -> dict[str, VariableInfo]:
    """``VariableInfo`` for each of ``model``'s parameters, sparse where its module makes the gradient sparse.

    Use this (not ``variables_from_parameters(model.named_parameters())``, which marks
    nothing sparse) to write a model description: sparsity-aware builders such as
    ``parallax`` send exactly the variables marked sparse to the parameter servers.
    """
    return variables_from_parameters(model.named_parameters(), sparse_parameter_names(model))


def sparse_parameter_names(model: Any) -> set[str]:
    """Names of parameters owned by ``nn.Embedding``/``EmbeddingBag`` modules built with ``sparse=True``."""
    names = set()
    for module_name, module in model.named_modules():
        if getattr(module, "sparse", False) is True:
            names.update(f"{module_name}.{p}" if module_name else p for p, _ in module.named_parameters(recurse=False))
    return names


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComputeTiming:
    """Median compute time of one training step on one process, as profiled."""

    forward_s: float
    """From the first module's forward call to the start of the backward pass (loss included)."""
    backward_s: float
    """The backward pass (``loss.backward()``), gradient hooks included."""
    optimizer_s: float
    """The wrapped optimizer's own ``step()`` (the parameter update)."""
    step_s: float
    """One whole step, end of one ``optimizer.step()`` to the next (data, zero_grad... included)."""
    steps: int
    """How many steps the medians are taken over."""
    batch_size: int | None = None
    """Samples per step on one process, when the user told the profiler."""

    def __post_init__(self) -> None:
        errors = [f"{field} must be a finite number >= 0, got {getattr(self, field)!r}"
                  for field in ("forward_s", "backward_s", "optimizer_s", "step_s")
                  if not _is_seconds(getattr(self, field))]
        if not _is_count(self.steps, minimum=1):
            errors.append(f"steps must be an integer >= 1, got {self.steps!r}")
        if self.batch_size is not None and not _is_count(self.batch_size, minimum=1):
            errors.append(f"batch_size must be an integer >= 1 or null, got {self.batch_size!r}")
        if errors:
            raise ValueError("; ".join(errors))
        for field in ("forward_s", "backward_s", "optimizer_s", "step_s"):  # 0 and 0.0 hash alike
            object.__setattr__(self, field, float(getattr(self, field)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class VariableTiming:
    """When one variable's gradient becomes ready in the backward pass, and how much of it a step touches."""

    ready_order: int
    """0 for the first gradient ready in the backward pass, 1 for the next..."""
    ready_s: float
    """Median seconds from the start of the backward pass to this gradient being ready."""
    rows_touched: int | None = None
    """Median rows a step's gradient touches: for a sparse variable its distinct rows; for a dense
    one the rows with a nonzero element, given only when fewer than all (an ``nn.Embedding(sparse=False)``,
    whose gradient is zero but for the rows the batch looked up: it can travel as those rows,
    ``VarConfig.rows``); else None."""

    def __post_init__(self) -> None:
        errors = []
        if not _is_count(self.ready_order, minimum=0):
            errors.append(f"ready_order must be an integer >= 0, got {self.ready_order!r}")
        if not _is_seconds(self.ready_s):
            errors.append(f"ready_s must be a finite number >= 0, got {self.ready_s!r}")
        if self.rows_touched is not None and not _is_count(self.rows_touched, minimum=0):
            errors.append(f"rows_touched must be an integer >= 0 or null, got {self.rows_touched!r}")
        if errors:
            raise ValueError("; ".join(errors))
        object.__setattr__(self, "ready_s", float(self.ready_s))  # 0 and 0.0 hash alike


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelDescription:
    """A model as the simulator sees it: its variables and, when profiled, its compute timing."""

    variables: dict[str, VariableInfo]
    """Every trainable variable, in the model's parameter order."""
    name: str | None = None
    """A label for the model (e.g. the zoo model's name)."""
    timing: ComputeTiming | None = None
    """Per-step compute time; None for a plain (unprofiled) description."""
    variable_timing: dict[str, VariableTiming] = dataclasses.field(default_factory=dict)
    """Per variable name; a variable that got no gradient while profiled has none."""
    meta: dict[str, str] = dataclasses.field(default_factory=dict)
    """Provenance (torch, horovod and hybridsync versions, host, date, command): not part of the id."""

    def __post_init__(self) -> None:
        errors = _consistency_errors(self.variables, self.variable_timing)
        errors += [f"meta {key!r}: expected a string, got {value!r}" for key, value in self.meta.items()
                   if not isinstance(key, str) or not isinstance(value, str)]
        if errors:
            raise ValueError("invalid model description:\n  - " + "\n  - ".join(errors))

    def to_dict(self) -> dict[str, Any]:
        """The document ``save_description`` writes (None fields omitted, variables in order)."""
        doc: dict[str, Any] = {"version": DESCRIPTION_VERSION}
        if self.name is not None:
            doc["name"] = self.name
        if self.timing is not None:
            doc["timing"] = {key: value for key, value in dataclasses.asdict(self.timing).items()
                             if value is not None}
        if self.meta:
            doc["meta"] = dict(self.meta)
        doc["variables"] = [_variable_entry(info, self.variable_timing.get(name))
                            for name, info in self.variables.items()]
        return doc


def _variable_entry(info: VariableInfo, timing: VariableTiming | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": info.name, "shape": list(info.shape), "dtype": info.dtype,
                             "sparse": info.sparse}
    if timing is not None:
        entry.update(ready_order=timing.ready_order, ready_s=timing.ready_s)
        if timing.rows_touched is not None:
            entry["rows_touched"] = timing.rows_touched
    return entry


def description_id(desc: ModelDescription) -> str:
    """16 hex digits naming what the description says: equal on every machine for equal content.

    Hashes the canonical JSON (sorted keys, variables sorted by name) of everything but
    ``meta``: re-saving a description, or profiling provenance, never changes its id;
    another shape, sparsity or timing does.
    """
    doc = desc.to_dict()
    doc.pop("meta", None)
    doc["variables"] = sorted(doc["variables"], key=lambda entry: entry["name"])
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def load_description(path: str | os.PathLike) -> ModelDescription:
    """Read a model description file, plain (variables only) or profiled."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read model description {path!r}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"model description {path!r} is not valid JSON: {e}") from e
    return parse_description(doc, where=path)


def save_description(desc: ModelDescription, path: str | os.PathLike) -> None:
    """Write ``desc`` as JSON, one variable per line; atomically (a reader never sees half a file)."""
    doc = desc.to_dict()
    lines = [f" {json.dumps(key)}: {json.dumps(value, allow_nan=False)}" for key, value in doc.items()
             if key != "variables"]
    variables = ",\n".join(f"  {json.dumps(entry)}" for entry in doc["variables"])
    lines.append(f' "variables": [\n{variables}\n ]' if variables else ' "variables": []')
    path = os.fspath(path)
    partial = f"{path}.partial-{os.getpid()}"
    with open(partial, "w", encoding="utf-8") as f:
        f.write("{\n" + ",\n".join(lines) + "\n}\n")
    os.replace(partial, path)


def parse_description(doc: Any, where: str = "model description") -> ModelDescription:
    """Validate and convert a description document; one ``ValueError`` names every culprit."""
    if not isinstance(doc, Mapping):
        raise ValueError(f"{where}: expected a JSON object with \"variables\", got {type(doc).__name__}")
    errors = [f"unknown top-level field {key!r} (known: {', '.join(_TOP_LEVEL_KEYS)})"
              for key in doc if key not in _TOP_LEVEL_KEYS]
    if doc.get("version", DESCRIPTION_VERSION) != DESCRIPTION_VERSION:
        errors.append(f"version {doc['version']!r} is not supported (this hybridsync reads {DESCRIPTION_VERSION})")
    name = doc.get("name")
    if name is not None and not isinstance(name, str):
        errors.append(f"name: expected a string, got {name!r}")
    entries = doc.get("variables")
    if not isinstance(entries, list):
        errors.append("variables: expected a list of {\"name\", \"shape\", ...} objects")
        entries = []
    variables, variable_errors = parse_variable_entries(entries)
    errors += variable_errors
    variable_timing = {}
    for i, entry in enumerate(entries):
        name_i = str(entry.get("name")) if isinstance(entry, Mapping) else None
        parsed = _parse_variable_timing(entry, f"variable {name_i!r}" if name_i in variables else f"entry {i}",
                                        errors)
        if parsed is not None and name_i in variables:
            variable_timing[name_i] = parsed
    timing = _parse_timing(doc.get("timing"), errors)
    meta = doc.get("meta", {})
    if not isinstance(meta, Mapping) or not all(isinstance(v, str) for v in meta.values()):
        errors.append(f"meta: expected an object of strings, got {meta!r}")
        meta = {}
    errors += _consistency_errors(variables, variable_timing)
    if errors:
        raise ValueError(f"{where}:\n  - " + "\n  - ".join(errors))
    return ModelDescription(variables=variables, name=name, timing=timing, variable_timing=variable_timing,
                            meta=dict(meta))


def load_model_description(path: str | os.PathLike) -> dict[str, VariableInfo]:
    """Read a model description: ``{"variables": [{"name", "shape", "dtype"?, "sparse"?}, ...]}``."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return parse_model_description(doc, where=os.fspath(path))


def parse_model_description(doc: Mapping[str, Any], where: str = "model description") -> dict[str, VariableInfo]:
    """Validate and convert a model description document; ``ValueError`` names every bad entry.

    Reads only the variables' ``name``, ``shape``, ``dtype`` and ``sparse``: a profiled
    description loads here too, its timing ignored.
    """
    entries = doc.get("variables") if isinstance(doc, Mapping) else None
    if not isinstance(entries, list):
        raise ValueError(f"{where}: expected {{\"variables\": [...]}}")
    out, errors = parse_variable_entries(entries)
    if errors:
        raise ValueError(f"{where}:\n  - " + "\n  - ".join(errors))
    return out


def parse_variable_entries(entries: list[Any]) -> tuple[dict[str, VariableInfo], list[str]]:
    """``VariableInfo`` per valid entry of a description's ``variables`` list, and one message per bad one."""
    errors, out = [], {}
    for i, entry in enumerate(entries):
        try:
            info = VariableInfo(name=str(entry["name"]), shape=tuple(int(d) for d in entry["shape"]),
                                dtype=str(entry.get("dtype", "float32")), sparse=bool(entry.get("sparse", False)))
        except (KeyError, TypeError, ValueError) as e:
            errors.append(f"entry {i}: needs 'name' and an integer 'shape' ({e!r})")
            continue
        if info.dtype not in DTYPES:
            errors.append(f"entry {i} ({info.name}): unknown dtype {info.dtype!r}")
        if info.name in out:
            errors.append(f"entry {i}: duplicate variable name {info.name!r}")
        out[info.name] = info
    return out, errors


def save_model_description(variables: Mapping[str, VariableInfo], path: str | os.PathLike) -> None:
    """Write the description that ``load_model_description`` reads."""
    doc = {"variables": [{"name": v.name, "shape": list(v.shape), "dtype": v.dtype, "sparse": v.sparse}
                         for v in variables.values()]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def _parse_variable_timing(entry: Any, label: str, errors: list[str]) -> VariableTiming | None:
    """The timing fields of one ``variables`` entry (None if it has none); problems go to ``errors``."""
    if not isinstance(entry, Mapping):
        return None  # parse_variable_entries has named it
    errors += [f"{label}: unknown field {key!r} (known: {', '.join(_VARIABLE_KEYS)})"
               for key in entry if key not in _VARIABLE_KEYS]
    if "sparse" in entry and not isinstance(entry["sparse"], bool):
        errors.append(f"{label}: sparse must be true or false, got {entry['sparse']!r}")
    present = [key for key in ("ready_order", "ready_s") if key in entry]
    if len(present) == 1:
        errors.append(f"{label}: ready_order and ready_s go together, only {present[0]} is given")
    if len(present) < 2:
        if "rows_touched" in entry:
            errors.append(f"{label}: rows_touched without ready_order and ready_s")
        return None
    try:
        return VariableTiming(ready_order=entry["ready_order"], ready_s=entry["ready_s"],
                              rows_touched=entry.get("rows_touched"))
    except ValueError as e:
        errors.append(f"{label}: {e}")
        return None


def _parse_timing(raw: Any, errors: list[str]) -> ComputeTiming | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        errors.append(f"timing: expected an object, got {raw!r}")
        return None
    unknown = [key for key in raw if key not in _TIMING_KEYS]
    missing = [key for key in _TIMING_KEYS[:5] if key not in raw]
    errors += [f"timing: unknown field {key!r} (known: {', '.join(_TIMING_KEYS)})" for key in unknown]
    errors += [f"timing: missing field {key!r}" for key in missing]
    if unknown or missing:
        return None
    try:
        return ComputeTiming(**raw)
    except ValueError as e:
        errors.append(f"timing: {e}")
        return None


def _consistency_errors(variables: Mapping[str, VariableInfo],
                        variable_timing: Mapping[str, VariableTiming]) -> list[str]:
    """What no single field shows: timing of unknown variables, rows beyond a variable's, the ready order."""
    errors = [f"variable {name!r}: has timing but is not among the variables"
              for name in variable_timing if name not in variables]
    for name, timing in variable_timing.items():
        info = variables.get(name)
        if info is None or timing.rows_touched is None:
            continue
        if not info.shape:
            errors.append(f"variable {name!r}: rows_touched is meaningless for a scalar")
        elif timing.rows_touched > info.shape[0]:
            errors.append(f"variable {name!r}: rows_touched {timing.rows_touched} exceeds its "
                          f"{info.shape[0]} rows")
    by_order = sorted(variable_timing.items(), key=lambda item: item[1].ready_order)
    orders = [timing.ready_order for _, timing in by_order]
    if orders != list(range(len(orders))):
        errors.append(f"ready_order must number the {len(orders)} timed variables 0..{len(orders) - 1} once "
                      f"each, got {orders}")
    else:
        errors += [f"variable {later!r}: ready_s {t_later.ready_s} is before that of {earlier!r} "
                   f"({t_earlier.ready_s}), which is earlier in ready_order"
                   for (earlier, t_earlier), (later, t_later) in zip(by_order, by_order[1:])
                   if t_later.ready_s < t_earlier.ready_s]
    return errors


def _is_seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _is_count(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
