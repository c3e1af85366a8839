"""Names of TensorFlow variables as strategy files and model descriptions know them."""
from __future__ import annotations

from typing import Any, Sequence


def variable_name(variable: Any) -> str:
    """Keras 3's unique ``path`` (``dense/kernel``), else TensorFlow's ``name`` without its ``:0``."""
    name = getattr(variable, "path", None) or variable.name
    return name[:-2] if name.endswith(":0") else name


def variable_names(variables: Sequence[Any]) -> list[str]:
    """One unique name per variable, in order. Variables that share a name (two layers made without
    names in different scopes) get ``_1``, ``_2``... after the first, as Keras names layers."""
    seen: dict[str, int] = {}
    names = []
    for variable in variables:
        base = variable_name(variable)
        count = seen.get(base, 0)
        seen[base] = count + 1
        name = base if count == 0 else f"{base}_{count}"
        while name in seen and count:  # a variable already called "x_1" keeps its name
            count += 1
            name = f"{base}_{count}"
        seen.setdefault(name, 1)
        names.append(name)
    return names
