"""Encodings of layer tensors in memory: smaller snapshots, with the error they introduce measured.

* :mod:`~kvsnap.encoding.lossless`: byte planes of 16/32/64-bit floats, entropy-coded (zstd) in
  independent chunks of whole pages; bit-exact. ``encode_pages``/``decode_pages``, the chunk
  table and its check.
* :mod:`~kvsnap.encoding.fp8`: e4m3 values with one fp32 scale per (block, head), quantized
  with torch ops where the pages lie; ``dequantize`` is the host twin of the device kernel
  (:mod:`kvsnap.transfer.page_dequant`).
* :mod:`~kvsnap.encoding.measure` and :mod:`~kvsnap.encoding.report`: the error of decoded
  pages against their originals (per tensor, and an attention check per layer) as an
  ``ErrorReport`` that serialises to the metadata's JSON.

Bytes and tensors in memory only: nothing here reads or writes a file.
"""

from kvsnap.encoding.report import (
    AttentionError,
    ErrorBounds,
    ErrorReport,
    TensorError,
)

__all__ = ["AttentionError", "ErrorBounds", "ErrorReport", "TensorError"]
