"""Image classifiers on small synthetic images: VGG-like (a few huge FC tensors hold most bytes)
and ResNet-like (many small conv / batch-norm tensors)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import torch
from torch import nn

from hybridsync.zoo.base import ZooModel, teacher

NUM_CLASSES = 10
NOISE = 1.0
"""Images are a class prototype plus Gaussian noise of this standard deviation."""


class VGG(nn.Module):
    """Three narrow conv + batch-norm stages, then two wide fully connected layers: as in VGG, the
    head holds almost all bytes (batch norm only makes the loss fall within tens of steps)."""

    def __init__(self, channels: tuple[int, ...] = (8, 16, 32), image: int = 32, hidden: int = 1024,
                 num_classes: int = NUM_CLASSES):
        super().__init__()
        layers, width = [], 3
        for c in channels:
            layers += [nn.Conv2d(width, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2)]
            width = c
        self.features = nn.Sequential(*layers)
        flat = width * (image // 2 ** len(channels)) ** 2
        self.classifier = nn.Sequential(nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                        nn.Linear(hidden, num_classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convs with batch norm, a 1x1 projection when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet-34's layout (3, 4, 6, 3 basic blocks) with narrow channels: 100+ small tensors."""

    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), channels: tuple[int, ...] = (8, 16, 32, 64),
                 num_classes: int = NUM_CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels[0], 3, 1, 1, bias=False), nn.BatchNorm2d(channels[0]),
                                  nn.ReLU())
        stages, width = [], channels[0]
        for i, (count, c) in enumerate(zip(blocks, channels)):
            for j in range(count):
                stages.append(BasicBlock(width, c, 2 if i > 0 and j == 0 else 1))
                width = c
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(self.stages(self.stem(images)).mean(dim=(2, 3)))


@functools.lru_cache(maxsize=None)
def _prototypes(name: str, image: int) -> torch.Tensor:
    return torch.randn(NUM_CLASSES, 3, image, image, generator=teacher(name))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageModel(ZooModel):
    """Noisy copies of one fixed prototype image per class; cross-entropy over the classes."""

    image_size: int
    """Side of the square RGB images, in pixels."""
    architecture: Literal["vgg", "resnet"]
    channels: tuple[int, ...] | None = None
    """Channels per stage (default: ``VGG``'s or ``ResNet``'s own)."""
    blocks: tuple[int, ...] | None = None
    """``resnet``: basic blocks per stage (default ResNet-34's 3, 4, 6, 3)."""
    hidden: int = 1024
    """``vgg``: width of the two fully connected layers."""

    def build(self) -> nn.Module:
        if self.architecture == "vgg":
            return VGG(**self._given(channels=self.channels), image=self.image_size, hidden=self.hidden)
        return ResNet(**self._given(blocks=self.blocks, channels=self.channels))

    @staticmethod
    def _given(**fields: tuple[int, ...] | None) -> dict[str, tuple[int, ...]]:
        return {name: value for name, value in fields.items() if value is not None}

    def make_batch(self, generator: torch.Generator,
                   batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        size = self._batch_size(batch_size)
        target = torch.randint(0, NUM_CLASSES, (size,), generator=generator)
        noise = torch.randn(size, 3, self.image_size, self.image_size, generator=generator)
        return _prototypes(self.name, self.image_size)[target] + NOISE * noise, target
