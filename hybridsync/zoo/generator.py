"""The model generator: many architectures, so the simulator learns what transfers between models.

Four zoo models cannot teach a simulator to rank a fifth. The generator samples
architectures from five families, each a real trainable torch model with synthetic data as
the zoo's (the loss falls within tens of steps):

- ``recsys``: several sparse embedding tables (one per categorical field) + an MLP;
- ``mlp``: fully connected layers with layer norm (dense, few large tensors);
- ``cnn``: VGG-like (narrow convs, wide FC head) or ResNet-like (many small tensors);
- ``transformer``: BERT-like encoders (dense token embedding, many mid-size tensors);
- ``widedeep``: a huge sparse linear part over hashed crosses beside a deep tower.

A generated model is named ``gen-<family>-<k>`` (``gen-recsys-7``): its widths, depths,
embedding sizes and batch size are drawn from ``numpy.random.Generator`` seeded with
(``SEED``, the family, ``k``) only, so the same name builds the same architecture on every
machine. A draw is kept only if the model fits the emulated cluster's budget
(``TOTAL_BYTES``, ``DENSE_BYTES``, ``STEP_MACS``), so that its step time is ~20-400 ms there:
communication matters, and a sweep over many models stays affordable.

    python -m hybridsync.zoo.train --catalogue                # the catalogue (GENERATED_MODELS) as a table
    python -m hybridsync.zoo.train --model gen-cnn-3 --describe
"""
from __future__ import annotations

import functools
import re
import zlib
from typing import Any, Callable

import numpy as np
import torch

from hybridsync.zoo.base import ZooModel, forward, model_stats
from hybridsync.zoo.bert import BertModel
from hybridsync.zoo.tabular import MLPModel, RecommenderModel
from hybridsync.zoo.vision import ImageModel

SEED = 20211
FAMILIES: tuple[str, ...] = ("recsys", "mlp", "cnn", "transformer", "widedeep")
PER_FAMILY = 6
"""Models per family in the catalogue the dataset is measured on (any ``k`` builds a model)."""
GENERATED_MODELS: tuple[str, ...] = tuple(f"gen-{family}-{k}" for family in FAMILIES for k in range(PER_FAMILY))
NAME = re.compile(r"gen-([a-z]+)-(0|[1-9][0-9]*)")

TOTAL_BYTES = (1e6, 60e6)
"""Bounds on all parameters' bytes (sparse tables included: most of their rows never travel)."""
DENSE_BYTES = (0.25e6, 6e6)
"""Bounds on the dense-gradient bytes: all of them travel every step (6 MB ring all-reduced at
250 Mbit/s is ~0.3 s)."""
STEP_MACS = 200e6
"""Most multiply-accumulates of a forward pass at the model's batch size (the zoo's ``vgg``:
77e6): a rank's compute stays a few tens of ms while 4 ranks share 2 cores."""
MAX_DRAWS = 1000


def _descending(rng: np.random.Generator, depth: int, widths: list[int]) -> tuple[int, ...]:
    return tuple(sorted((int(rng.choice(widths)) for _ in range(depth)), reverse=True))


def _recsys(name: str, rng: np.random.Generator) -> ZooModel:
    tables = tuple(int(rng.choice([1_000, 5_000, 20_000, 50_000, 100_000, 200_000, 500_000]))
                   for _ in range(int(rng.integers(2, 9))))
    dim = int(rng.choice([8, 16, 32, 64]))
    hidden = _descending(rng, int(rng.integers(1, 4)), [64, 128, 256, 512, 1024])
    return RecommenderModel(
        name=name, summary=f"recommender: {len(tables)} sparse tables (dim {dim}) + MLP {_widths(hidden)}",
        batch_size=int(rng.choice([128, 256, 512, 1024])), learning_rate=0.01, tables=tables, dim=dim,
        dense_features=int(rng.choice([4, 8, 16, 32])), hidden=hidden, popularity=float(rng.choice([2.0, 4.0, 8.0])))


def _widedeep(name: str, rng: np.random.Generator) -> ZooModel:
    tables = tuple(int(rng.choice([1_000, 5_000, 20_000, 50_000, 100_000, 200_000]))
                   for _ in range(int(rng.integers(3, 8))))
    wide_rows = int(rng.choice([1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22]))
    dim = int(rng.choice([8, 16, 32]))
    hidden = _descending(rng, int(rng.integers(2, 5)), [128, 256, 512, 1024])
    return RecommenderModel(
        name=name, summary=f"wide & deep: {wide_rows:,}-row sparse wide part, {len(tables)} sparse tables "
                           f"(dim {dim}) + MLP {_widths(hidden)}",
        batch_size=int(rng.choice([128, 256, 512, 1024])), learning_rate=0.01, tables=tables, dim=dim,
        dense_features=int(rng.choice([4, 8, 16, 32])), hidden=hidden, popularity=float(rng.choice([2.0, 4.0, 8.0])),
        wide_rows=wide_rows)


def _mlp(name: str, rng: np.random.Generator) -> ZooModel:
    hidden = tuple(int(rng.choice([256, 512, 1024, 2048])) for _ in range(int(rng.integers(2, 7))))
    in_features, classes = int(rng.choice([64, 128, 256, 512, 1024])), int(rng.choice([10, 50, 100, 500]))
    return MLPModel(name=name, summary=f"MLP {in_features}-{_widths(hidden)}-{classes} with layer norm",
                    batch_size=int(rng.choice([32, 64, 128, 256])), learning_rate=0.02, momentum=0.9,
                    in_features=in_features, hidden=hidden, num_classes=classes)


def _cnn(name: str, rng: np.random.Generator) -> ZooModel:
    stages = int(rng.integers(2, 5))
    channels = [int(rng.choice([8, 16, 32]))]
    for _ in range(stages - 1):
        channels.append(min(channels[-1] * int(rng.choice([1, 2, 2])), 256))
    batch = int(rng.choice([16, 32, 64]))
    if rng.random() < 0.4:  # ResNet draws fail the compute bound more often: fewer VGG draws evens the mix
        image, hidden = int(rng.choice([16, 32])), int(rng.choice([256, 512, 768, 1024, 1536, 2048]))
        return ImageModel(name=name, summary=f"VGG-like: convs {_widths(channels)} on {image}x{image}, FC {hidden} x 2",
                          batch_size=batch, learning_rate=0.02, momentum=0.9, image_size=image, architecture="vgg",
                          channels=tuple(channels), hidden=hidden)
    blocks = tuple(int(rng.integers(1, 5)) for _ in range(stages))
    image = int(rng.choice([8, 16]))
    return ImageModel(name=name, summary=f"ResNet-like: blocks {_widths(blocks)}, channels {_widths(channels)} "
                                         f"on {image}x{image}",
                      batch_size=batch, learning_rate=0.05, momentum=0.9, image_size=image, architecture="resnet",
                      channels=tuple(channels), blocks=blocks)


def _transformer(name: str, rng: np.random.Generator) -> ZooModel:
    dim, blocks = int(rng.choice([64, 96, 128, 160, 192, 256])), int(rng.integers(1, 5))
    vocab = int(rng.choice([2_000, 3_000, 4_000, 6_000, 8_000, 12_000, 16_000]))
    seq_len = int(rng.choice([16, 32, 64]))
    return BertModel(name=name, summary=f"BERT-like: vocab {vocab:,}, dim {dim}, {blocks} block(s), seq {seq_len}",
                     batch_size=int(rng.choice([16, 32, 64])), learning_rate=0.02, momentum=0.9, vocab=vocab,
                     seq_len=seq_len, dim=dim, heads=int(rng.choice([2, 4, 8])), ffn=dim * int(rng.choice([2, 4])),
                     blocks=blocks)


_SAMPLERS: dict[str, Callable[[str, np.random.Generator], ZooModel]] = {
    "recsys": _recsys, "mlp": _mlp, "cnn": _cnn, "transformer": _transformer, "widedeep": _widedeep}


def _widths(values: tuple[int, ...]) -> str:
    return "-".join(map(str, values))


def parse_name(name: str) -> tuple[str, int]:
    """``(family, k)`` of ``gen-<family>-<k>``; ``ValueError`` for anything else."""
    match = NAME.fullmatch(name)
    if match is None or match.group(1) not in FAMILIES:
        raise ValueError(f"{name!r} is not a generated model name: expected gen-<family>-<k> with family one of "
                         f"{', '.join(FAMILIES)} and k = 0, 1, 2, ... (e.g. gen-recsys-7)")
    return match.group(1), int(match.group(2))


def is_generated(name: str) -> bool:
    """Whether ``name`` is a well-formed generated model name."""
    try:
        parse_name(name)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def generate(name: str) -> ZooModel:
    """The generated model called ``name`` (``gen-<family>-<k>``): the first draw of its seeded
    generator that fits the budget. Pure function of the name."""
    family, k = parse_name(name)
    rng = np.random.default_rng([SEED, zlib.crc32(family.encode()), k])
    for _ in range(MAX_DRAWS):
        model = _SAMPLERS[family](name, rng)
        if fits_budget(model):
            return model
    raise AssertionError(f"{name}: no draw of {MAX_DRAWS} fits the budget")  # the families' ranges make this unreachable


def fits_budget(model: ZooModel) -> bool:
    """Whether ``model``'s bytes and forward compute are within the generator's bounds."""
    with torch.device("meta"):
        built = model.build()
    stats = model_stats(built)
    return (TOTAL_BYTES[0] <= stats["bytes"] <= TOTAL_BYTES[1] and DENSE_BYTES[0] <= stats["dense_bytes"] <= DENSE_BYTES[1]
            and forward_macs(model, built) * model.batch_size <= STEP_MACS)


def forward_macs(model: ZooModel, built: torch.nn.Module) -> int:
    """Multiply-accumulates of the linear and convolution layers in one sample's forward pass
    (attention's own products and element-wise work are left out: small here). ``built`` is
    ``model.build()`` on the meta device."""
    macs = 0

    def count(module: torch.nn.Module, _: Any, output: torch.Tensor) -> None:
        nonlocal macs
        if isinstance(module, torch.nn.Linear):
            macs += output.numel() * module.in_features
        else:
            kernel = module.weight.shape[1:].numel()  # in_channels / groups x kernel area
            macs += output.numel() * kernel

    hooks = [m.register_forward_hook(count) for m in built.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    with torch.device("cpu"):  # even inside a meta context: the data's teacher tensors are cached
        inputs, _ = model.make_batch(torch.Generator().manual_seed(0), 2)  # batch norm needs 2 samples
    to_meta = lambda t: t.to("meta")  # noqa: E731
    with torch.no_grad():
        forward(built, tuple(map(to_meta, inputs)) if isinstance(inputs, tuple) else to_meta(inputs))
    for hook in hooks:
        hook.remove()
    return macs // 2


def catalogue_table(names: tuple[str, ...] = GENERATED_MODELS) -> str:
    """A Markdown table of ``names``: summary, parameters, MB (dense), tensors, sparse, batch, forward MACs."""
    rows = ["| model | summary | parameters | MB (dense) | tensors | sparse | batch | forward MMACs |",
            "|---|---|---|---|---|---|---|---|"]
    for name in names:
        model = generate(name)
        with torch.device("meta"):
            built = model.build()
        s = model_stats(built)
        rows.append(f"| `{name}` | {model.summary} | {s['parameters']:,} | {s['bytes'] / 1e6:.2f} "
                    f"({s['dense_bytes'] / 1e6:.2f}) | {s['tensors']} | {s['sparse_tensors']} | {model.batch_size} | "
                    f"{forward_macs(model, built) * model.batch_size / 1e6:.0f} |")
    return "\n".join(rows)
