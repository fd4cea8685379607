"""fp8 layer tensors of an encoded file decoded on the host (the host twin of the device
kernel, :func:`kvsnap.encoding.fp8.dequantize`), their scales checked first."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvsnap.encoding import fp8
from kvsnap.errors import SnapshotCorruptError
from kvsnap.format import encoded as enc
from kvsnap.format.container import TensorEntry

if TYPE_CHECKING:
    from kvsnap.encoded.file import EncodedFile

#: The cache dtype of each safetensors name fp8 pages decode into.
DECODED = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def heads_of(entry: TensorEntry) -> int:
    """Scales per block of a layer tensor: its heads (an MLA tensor is one head)."""
    return entry.shape[2] if len(entry.shape) == 4 else 1


def fp8_parts(encoded: EncodedFile, entry: TensorEntry) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored e4m3 values (``uint8``, the tensor's shape) and checked scales of a layer
    tensor stored as fp8."""
    if entry.dtype not in DECODED:
        raise SnapshotCorruptError(
            f"fp8 pages cannot decode into {entry.dtype}", file=encoded.file, tensor=entry.name
        )
    values = encoded.typed(entry.name, "F8_E4M3", entry.shape)
    scales_shape = (entry.shape[0], heads_of(entry))
    scales = encoded.typed(entry.name + enc.SCALES_SUFFIX, "F32", scales_shape)
    scale_tensor = torch.from_numpy(scales.view("<f4").reshape(scales_shape).copy())
    fp8.check_scales(scale_tensor, tensor=entry.name)
    return torch.from_numpy(values.reshape(entry.shape).copy()), scale_tensor


def decode_fp8_tensor(encoded: EncodedFile, entry: TensorEntry, out: np.ndarray) -> None:
    """Decode a layer tensor stored as fp8 into ``out`` (its bytes in the decoded file)."""
    values, scales = fp8_parts(encoded, entry)
    decoded = fp8.dequantize(values, scales, DECODED[entry.dtype]).contiguous()
    out[:] = decoded.view(torch.uint8).reshape(-1).numpy()
