"""Where a command's ``--model`` comes from: a model description file or a zoo model's name.

Kept apart from the zoo so that commands stay importable (and fast) without torch: the
zoo is imported only when ``--model`` is not a file.
"""
from __future__ import annotations

import os

from hybridsync.variables import VariableInfo, load_model_description


def load_model_variables(model: str) -> dict[str, VariableInfo]:
    """The variables of ``model``: an existing description file wins, else a zoo model name
    (``ncf``, ``bert``, ``vgg``, ``resnet``, or generated: ``gen-recsys-7``); ``ValueError`` naming
    both possibilities otherwise."""
    if os.path.exists(model):
        return load_model_description(model)
    try:
        from hybridsync import zoo
    except ImportError as e:  # no torch here: only description files can be read
        raise ValueError(f"--model {model!r}: no such model description file, and the model zoo "
                         f"cannot be imported ({e})") from None
    if not zoo.is_model(model):
        raise ValueError(f"--model {model!r}: neither a model description file nor a zoo model "
                         f"(zoo models: {', '.join(zoo.ZOO_MODELS)}; generated: gen-<family>-<k>)")
    return zoo.describe(model)
