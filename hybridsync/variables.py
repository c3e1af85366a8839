"""What hybridsync needs to know about a model's variables, without the model itself.

Strategies are validated, builders run and the simulator reasons on ``VariableInfo``
records, so all of them work from a model description file on a laptop with no
framework and no cluster.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterable, Mapping

FLOATING_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz",
                             "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"})
"""What ``torch.dtype.is_floating_point`` says yes to: the dtypes fp16 compression casts."""
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
             "complex128": 16, "complex64": 8, "complex32": 4,
             **{name: 1 for name in FLOATING_DTYPES if name.startswith("float8")}}


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


def load_model_description(path: str | os.PathLike) -> dict[str, VariableInfo]:
    """Read a model description: ``{"variables": [{"name", "shape", "dtype"?, "sparse"?}, ...]}``."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return parse_model_description(doc, where=os.fspath(path))


def parse_model_description(doc: Mapping[str, Any], where: str = "model description") -> dict[str, VariableInfo]:
    """Validate and convert a model description document; ``ValueError`` names every bad entry.

    Reads only the variables' ``name``, ``shape``, ``dtype`` and ``sparse``: a profiled
    description (``hybridsync.description``) loads here too, its timing ignored.
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
        if info.dtype not in _ITEMSIZE:
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
