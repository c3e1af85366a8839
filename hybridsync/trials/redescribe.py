"""A model profiled again: point its stored trials at the new description (``hybridsync dataset redescribe``).

A description's id (``hybridsync.description.description_id``) hashes its timing, so a model
profiled again gets a new id while the trials in a store still name the old one. A re-profile
changes timing only: ``redescribe`` refuses a description whose variables (names, shapes, dtypes,
sparsity) differ from those the trials ran with, since those trials measured other messages.
The trials keep their ``uid`` (what an import skips by), job, host, times and step times; only
their ``description_id`` changes, and the old description leaves the store once no trial names it.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterable, Mapping

from hybridsync.description import ModelDescription, description_id, load_description, parse_description
from hybridsync.trials.store import TrialStore


@dataclasses.dataclass(frozen=True, kw_only=True)
class Relinked:
    """One model's trials, re-linked."""

    model: str
    old_ids: tuple[str, ...]
    """The descriptions its trials named before (sorted)."""
    new_id: str
    trials: int
    """Trials that named another description (0: they named ``new_id`` already)."""


def variable_differences(old: ModelDescription, new: ModelDescription) -> list[str]:
    """What differs between the variables of two descriptions (empty: the same variables)."""
    differences = [f"variable {name!r} only in the new description" for name in new.variables
                   if name not in old.variables]
    differences += [f"variable {name!r} missing from the new description" for name in old.variables
                    if name not in new.variables]
    for name in old.variables.keys() & new.variables.keys():
        before, after = old.variables[name], new.variables[name]
        differences += [f"variable {name!r}: {field} {getattr(before, field)!r} -> {getattr(after, field)!r}"
                        for field in ("shape", "dtype", "sparse") if getattr(before, field) != getattr(after, field)]
    return sorted(differences)


def load_descriptions(directory: str | os.PathLike[str],
                      models: Iterable[str] | None = None) -> dict[str, ModelDescription]:
    """``<model>.json`` of ``directory`` by model (the layout of ``data/descriptions``): the named
    ``models``, or every file there; ``ValueError`` for a named model without a file."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ValueError(f"descriptions: {folder} is not a directory")
    if models is None:
        return {path.stem: load_description(path) for path in sorted(folder.glob("*.json"))}
    missing = [model for model in models if not (folder / f"{model}.json").is_file()]
    if missing:
        raise ValueError(f"descriptions: no {', '.join(f'{m}.json' for m in missing)} in {folder}")
    return {model: load_description(folder / f"{model}.json") for model in models}


def redescribe(store: TrialStore, descriptions: Mapping[str, ModelDescription]) -> list[Relinked]:
    """Points every trial of each model (key) at its new description, all models or none: one
    ``ValueError`` names every model the store holds no trials of, whose description names another
    model, or whose variables differ from those of a description its trials name."""
    stored = store.descriptions()
    errors, relinked = [], []
    for model, new in sorted(descriptions.items()):
        old_ids = store.description_ids(model)
        if not old_ids:
            errors.append(f"{model}: the store holds no trials of it")
        if new.name is not None and new.name != model:
            errors.append(f"{model}: the new description is of model {new.name!r}")
        for old_id in sorted(old_ids):
            if old_id not in stored:
                errors.append(f"{model}: its trials' description {old_id} is not in the store (nothing to compare)")
                continue
            old = parse_description(stored[old_id]["doc"], where=f"description {old_id} ({model})")
            errors += [f"{model}: {difference} (a re-profile changes timing only)"
                       for difference in variable_differences(old, new)]
        relinked.append(Relinked(model=model, old_ids=tuple(sorted(old_ids)), new_id=description_id(new), trials=0))
    if errors:
        raise ValueError("cannot redescribe:\n  - " + "\n  - ".join(errors))
    counts = store.relink({r.model: (r.new_id, descriptions[r.model].to_dict()) for r in relinked})
    return [dataclasses.replace(r, trials=counts[r.model]) for r in relinked]
