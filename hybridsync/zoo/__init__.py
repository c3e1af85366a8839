"""Benchmark model zoo: four small PyTorch models whose gradient synchronization differs as
real models' does, with deterministic synthetic data.

- ``ncf``: large sparse embeddings (only touched rows travel) + a small MLP.
- ``bert``: a dense 4 MB token embedding + transformer blocks: many mid-size tensors.
- ``vgg``: small convs, then huge FC layers: three tensors hold most bytes.
- ``resnet``: 100+ small conv / batch-norm tensors.

Beside them, ``hybridsync.zoo.generator`` builds many more architectures, named
``gen-<family>-<k>`` (``GENERATED_MODELS`` is the catalogue the runtime dataset measures); every
function here takes those names too.

Importing this package imports torch (``import hybridsync`` does not import the zoo);
``python -m hybridsync.zoo.train`` trains one of them as a distributed job.
"""
from __future__ import annotations

from hybridsync.variables import VariableInfo, variables_from_model
from hybridsync.zoo.base import ZooModel, compute_ms, model_stats, train_step
from hybridsync.zoo.bert import BertModel
from hybridsync.zoo.generator import FAMILIES, GENERATED_MODELS, generate, is_generated
from hybridsync.zoo.ncf import NCFModel
from hybridsync.zoo.vision import ImageModel

__all__ = ["GENERATED_MODELS", "ZOO_MODELS", "ZooModel", "compute_ms", "describe", "get", "is_model", "model_stats",
           "train_step"]

_MODELS: dict[str, ZooModel] = {m.name: m for m in (
    NCFModel(name="ncf", summary="NCF-like recommender: 4 sparse embeddings (15 MB) + small MLP",
             batch_size=512, learning_rate=0.5),
    BertModel(name="bert", summary="BERT-like: dense token embedding + 2 transformer blocks (38 tensors)",
              batch_size=16, learning_rate=0.02, momentum=0.9),
    ImageModel(name="vgg", summary="VGG-like: 3 small conv+BN stages + 2 huge FC layers (top-3: 99% of bytes)",
               batch_size=32, learning_rate=0.02, momentum=0.9, image_size=32, architecture="vgg"),
    ImageModel(name="resnet", summary="ResNet-34-like with narrow channels: 100+ small conv/BN tensors",
               batch_size=32, learning_rate=0.05, momentum=0.9, image_size=8, architecture="resnet"),
)}

ZOO_MODELS: tuple[str, ...] = tuple(_MODELS)


def get(name: str) -> ZooModel:
    """The zoo model called ``name``, or the generated one (``gen-<family>-<k>``); ``ValueError``
    saying what names exist otherwise."""
    if name in _MODELS:
        return _MODELS[name]
    if is_generated(name):
        return generate(name)
    raise ValueError(f"unknown zoo model {name!r} (known: {', '.join(ZOO_MODELS)}; or a generated model "
                     f"gen-<family>-<k>, family one of {', '.join(FAMILIES)}, e.g. gen-recsys-7)")


def is_model(name: str) -> bool:
    """Whether ``get(name)`` gives a model: a zoo model's or a generated model's name."""
    return name in _MODELS or is_generated(name)


def describe(name: str) -> dict[str, VariableInfo]:
    """The model description of zoo model ``name`` (sparse embeddings marked sparse)."""
    return variables_from_model(get(name).build())
