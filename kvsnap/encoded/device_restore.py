"""An fp8 snapshot restored into CUDA caches: its e4m3 bytes and scales cross PCIe (half the
bytes of bf16) and are dequantized where they land, by the fused dequantizing scatter
(:mod:`kvsnap.transfer.page_dequant`), bit for bit what the host decode gives.

The encoded file was checked whole when it opened (its trailer covers every stored byte, its
signature with keys), so the pages are not checked again here. Its bytes are held in
page-aligned memory that is registered with CUDA on the first device restore (once per open
file, like the hot tier's files), so each layer tensor's range of stored blocks is one DMA
straight out of it into one device buffer, and one launch per fragment group scatters every
page; where registration is refused the ranges go through a pinned copy instead.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvsnap import host_registration
from kvsnap.encoded.file import EncodedFile
from kvsnap.encoding import fp8
from kvsnap.format import encoded as enc
from kvsnap.format.fit import check_fits
from kvsnap.layout import CacheLayout
from kvsnap.pipeline.jobs import RestoreResult, restore_pairs
from kvsnap.transfer import page_dequant
from kvsnap.transfer.page_copy import kernel_table
from kvsnap.transfer.page_table import PageTable

#: Encoded files registered with CUDA, by ``id`` (unregistered when the file is collected).
_REGISTERED: dict[int, bool] = {}


def fp8_restorable(encoded: EncodedFile | None, layouts: Sequence[CacheLayout]) -> bool:
    """Whether a restore of ``encoded`` into ``layouts`` takes this path: an fp8 snapshot
    whose every layer tensor is stored fp8, into CUDA caches."""
    if encoded is None or encoded.encoding["name"] != "fp8":
        return False
    if any(kind != "fp8" for kind in encoded.encoding["tensors"].values()):
        return False
    return all(layout.device.type == "cuda" for layout in layouts)


def _registered(encoded: EncodedFile) -> bool:
    """Register ``encoded``'s bytes with CUDA once (``False`` where that is refused)."""
    key = id(encoded)
    if key not in _REGISTERED:
        address = encoded.data.ctypes.data
        ok = (
            host_registration.register_host_range(
                address, encoded.data.nbytes, host_registration.PORTABLE
            )
            == 0
        )
        _REGISTERED[key] = ok
        if ok:
            weakref.finalize(encoded, _unregister, key, address)
    return _REGISTERED[key]


def _unregister(key: int, address: int) -> None:
    _REGISTERED.pop(key, None)
    host_registration.unregister_host_range(address)


def heads_of_shape(shape: tuple[int, ...]) -> int:
    return shape[2] if len(shape) == 4 else 1


def _upload(source: np.ndarray, target: torch.Tensor, registered: bool) -> None:
    host = torch.from_numpy(source)
    if target.device.type == "cuda" and not registered:
        host = host.pin_memory()
    target.copy_(host, non_blocking=True)


def _staged(
    encoded: EncodedFile, names: list[str], blocks: np.ndarray, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Each tensor's stored blocks ``min(blocks) .. max(blocks)`` copied to the device: the
    values, the scales of each page (rows: tensor, then ``blocks``) and each page's first byte
    in the values. On host memory (tests, under Triton's interpreter) plain copies."""
    low, high = int(blocks.min()), int(blocks.max()) + 1
    shape = encoded.layout.by_name[names[0]].shape
    page = int(np.prod(shape[1:]))
    heads = heads_of_shape(shape)
    span = (high - low) * page
    values = torch.empty(len(names) * span, dtype=torch.uint8, device=device)
    scales = torch.empty((len(names), high - low, heads), dtype=torch.float32, device=device)
    registered = device.type == "cuda" and _registered(encoded)
    for index, name in enumerate(names):
        _upload(
            encoded.tensor(name)[low * page : high * page],
            values[index * span : (index + 1) * span],
            registered,
        )
        table = encoded.tensor(name + enc.SCALES_SUFFIX).view("<f4").reshape(-1, heads)
        _upload(table[low:high], scales[index], registered)
    starts = (np.arange(len(names))[:, None] * span + (blocks - low)[None, :] * page).reshape(-1)
    # One row of scales per page, in page order (tensor, then block), as the kernel reads them.
    offsets = torch.from_numpy(blocks - low).to(device)
    return values, scales[:, offsets].reshape(-1, heads), starts


def restore_fp8(
    snapshot: Any,
    layout: CacheLayout | Sequence[CacheLayout],
    block_ids: Mapping[str, np.ndarray | Sequence[int]],
    model_fingerprint: str | None,
    force: bool,
) -> RestoreResult | None:
    """``Snapshot.restore`` of an encoded ``snapshot`` into ``layout`` (one layout or one per
    TP rank) on the device when :func:`fp8_restorable` says it takes this path; ``None`` when
    it does not (the pipeline restores the decoded file then)."""
    layouts = [layout] if isinstance(layout, CacheLayout) else list(layout)
    if not fp8_restorable(snapshot.encoded, layouts):
        return None
    return restore_fp8_on_device(
        snapshot, layouts, block_ids, model_fingerprint=model_fingerprint, force=force
    )


def restore_fp8_on_device(
    snapshot: Any,
    layouts: Sequence[CacheLayout],
    block_ids: Mapping[str, np.ndarray | Sequence[int]],
    *,
    model_fingerprint: str | None = None,
    force: bool = False,
) -> RestoreResult:
    """Restore the sequences of ``block_ids`` from the open fp8 ``snapshot`` (a
    ``kvsnap.Snapshot`` whose ``encoded`` is the file) into the CUDA caches of ``layouts``."""
    started = time.perf_counter()
    encoded: EncodedFile = snapshot.encoded
    check_fits(
        snapshot.metadata,
        layouts[0].geometry,
        path=snapshot.path,
        model_fingerprint=model_fingerprint,
        force=force,
    )
    capacity = min(layout.num_blocks for layout in layouts)
    snapshot_blocks, target_blocks, num_tokens = restore_pairs(
        snapshot.metadata.sequences, block_ids, capacity, snapshot.path
    )
    table = PageTable(list(layouts))
    names = list(table.names)
    for name in names:
        shape = encoded.layout.by_name[name].shape
        scales = encoded.tensor(name + enc.SCALES_SUFFIX).view("<f4")
        rows = torch.from_numpy(scales.reshape(shape[0], heads_of_shape(shape)).copy())
        fp8.check_scales(rows, tensor=name)
    device = layouts[0].device
    values, scales, starts = _staged(encoded, names, snapshot_blocks, device)
    page_tensors = np.repeat(np.arange(len(names)), len(snapshot_blocks))
    device_blocks = np.tile(target_blocks, len(names))
    copies = page_dequant.dequant_copies(table, page_tensors, device_blocks)
    kernel_arrays = torch.from_numpy(kernel_table(copies)).to(device, non_blocking=True)
    page_dequant.launch_dequant(
        copies,
        kernel_arrays,
        table,
        values,
        torch.from_numpy(starts).to(device, non_blocking=True),
        scales,
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return RestoreResult(
        num_sequences=len(block_ids),
        num_tokens=num_tokens,
        num_blocks=len(snapshot_blocks),
        num_bytes=values.numel() + 4 * scales.numel(),
        seconds=time.perf_counter() - started,
        backend="fp8-dequant",
    )
