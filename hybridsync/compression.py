"""Wire compression with Horovod's ``Compressor`` interface, so either library's objects fit.

``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``; the
fp16 variant casts floating tensors to float16 on the wire and back afterwards. Also the one
definition of a dense gradient's nonzero rows (``nonzero_row_indices``), which ``VarConfig.rows``
sends and the profiler counts as ``rows_touched``, so the two never disagree.
"""
from __future__ import annotations

from typing import Any

import torch


class NoneCompressor:
    """Sends the tensor as it is (and in place, so the result lands in the gradient)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor:
    """Halves the bytes of floating-point gradients; other dtypes pass unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        dtype = tensor.dtype
        if dtype.is_floating_point:
            tensor = tensor.type(torch.float16)
        return tensor, dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx.is_floating_point:
            tensor = tensor.type(ctx)
        return tensor


class Compression:
    """The compressors by name, as ``hvd.Compression`` spells them."""

    none = NoneCompressor
    fp16 = FP16Compressor


def compression_name(compressor: Any) -> str:
    """The strategy name of a compressor, for the routing plan's wire sizes: ``fp16`` for
    hybridsync's or Horovod's ``FP16Compressor``, else ``none`` (a custom compressor's sizes
    are known only when it runs; the router declares parameter-server keys from what it sends)."""
    if compressor is FP16Compressor or getattr(compressor, "__name__", None) == "FP16Compressor":
        return "fp16"
    return "none"


def compressor_named(name: str | None, default: Any) -> Any:
    """The compressor a strategy's ``compression`` names; ``None`` keeps the optimizer's."""
    if name is None:
        return default
    return {"none": Compression.none, "fp16": Compression.fp16}[name]


def nonzero_row_indices(tensor: torch.Tensor) -> torch.Tensor:
    """Indices along dim 0 of the rows of a dense tensor with a nonzero element (NaN counts as
    nonzero): the rows a ``rows`` message sends (``router.runtime.nonzero_rows``) and the profiler
    counts (``hooks.profiler.nonzero_rows``)."""
    return tensor.reshape(tensor.shape[0], -1).ne(0).any(dim=1).nonzero().squeeze(1)
