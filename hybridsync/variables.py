"""What hybridsync needs to know about one of a model's variables, without the model itself.

Strategies are validated, builders run and the simulator reasons on ``VariableInfo``
records, so all of them work from a model description file on a laptop with no
framework and no cluster. The file itself (reading, writing, checking it) is
``hybridsync.description``'s; its plain readers and writer are still importable from here.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any, Iterable

FLOATING_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz",
                             "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"})
"""What ``torch.dtype.is_floating_point`` says yes to: the dtypes fp16 compression casts."""
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
             "complex128": 16, "complex64": 8, "complex32": 4,
             **{name: 1 for name in FLOATING_DTYPES if name.startswith("float8")}}
DTYPES = frozenset(_ITEMSIZE)
"""Every dtype name a model description may give."""
_DESCRIPTION_NAMES = frozenset({"load_model_description", "parse_model_description", "save_model_description",
                                "parse_variable_entries"})
"""Where they were before ``hybridsync.description`` became the one home of description files."""


def __getattr__(name: str) -> Any:
    if name in _DESCRIPTION_NAMES:
        return getattr(importlib.import_module("hybridsync.description"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
