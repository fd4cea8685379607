"""Writing a kvsnap snapshot's sequences into a vLLM 0.32 fs-tier namespace.

Each full block of a sequence becomes the block file vLLM would have stored for it: named by
vLLM's prefix hash of the block's tokens, placed under ``<ns>_r0/<hhh>/<hh>_g0/``, holding
every worker's region of every layer's page in the engine's page order, padded to 4096 bytes,
written to a temporary name and renamed (as vLLM writes). The namespace's ``config.json`` says
what vLLM's tier expects: everything the snapshot does not match is refused before anything is
written. vLLM stores full blocks only; a sequence's partial last block is left out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsnap.errors import IncompatibleSnapshotError
from kvsnap.layout import KVGeometry
from kvsnap.snapshot import Snapshot

from .pages import FileOrder
from .vllm_fs import VLLMFsNamespace
from .vllm_fs_config import (
    CONFIG_NAME,
    DEFAULT_HASH_SEED,
    block_path,
    namespace_name,
    namespace_of,
    namespaces_under,
    prefix_hashes,
    read_config,
)

_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass
class ExportResult:
    """What an export wrote: the files, the blocks already there, the tokens left out."""

    path: str
    written: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    sequences: int = 0
    tokens_left_out: int = 0
    notes: list[str] = field(default_factory=list)


def target_namespace(root: Path, config: Path | None) -> Path:
    """The namespace to write into: the one ``root`` is or holds, or (``config`` given) the
    one that config names, created under ``root``."""
    if config is not None:
        fields = read_config(config)
        namespace = root / namespace_name(fields)
        namespace.mkdir(parents=True, exist_ok=True)
        target = namespace / CONFIG_NAME
        if not target.exists():
            target.write_text(json.dumps(fields, indent=2, sort_keys=True))
        return namespace
    found = namespace_of(root) if root.exists() else None
    if found is not None:
        return found
    spaces = namespaces_under(root) if root.is_dir() else []
    if len(spaces) == 1:
        return spaces[0]
    what = f"{len(spaces)} namespaces" if spaces else "no vLLM fs-tier namespace"
    raise ValueError(
        f"{root}: {what}: pass a namespace directory, or --config FILE with the config.json "
        "vLLM writes when its fs tier starts (<root>/<model>_<hash>/config.json)"
    )


def export_vllm_fs(
    snapshot: Snapshot,
    root: str | Path,
    *,
    page_order: Any,
    config: str | Path | None = None,
    tp_size: int | None = None,
    model: str | Path | None = None,
    hash_seed: str | None = None,
) -> ExportResult:
    """Write every sequence of ``snapshot`` as vLLM fs-tier block files under ``root``.

    ``page_order`` is the engine's page order (``cells-nhd``, ``cells-hnd``, a probed order
    ``.npz`` or a :class:`~kvsnap.foreign.PageOrder`), ``tp_size`` the TP size of the engine
    that will read the files (a parallel-agnostic namespace lays them out per worker of that
    size; default 1), ``model`` a model directory whose config names the KV heads, and
    ``hash_seed`` the engine's ``PYTHONHASHSEED`` if it sets one. Raises
    :class:`~kvsnap.errors.IncompatibleSnapshotError` for a snapshot the namespace cannot hold.
    """
    namespace = target_namespace(Path(root), None if config is None else Path(config))
    geometry = snapshot.geometry
    hints: dict[str, Any] = {"page_order": page_order, "tp_size": tp_size, "model": model}
    target = VLLMFsNamespace(namespace, {k: v for k, v in hints.items() if v is not None})
    _check_fits(geometry, target)
    if target.heads() is None:
        # No model config to check against: the snapshot's own heads lay out the pages.
        hints.update(num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim)
        target = VLLMFsNamespace(namespace, {k: v for k, v in hints.items() if v is not None})
    order = target.file_order()
    file_bytes = target.block_file_size()
    assert file_bytes is not None
    rank_dir = namespace.with_name(f"{namespace.name}_r0")
    seed = hash_seed or DEFAULT_HASH_SEED
    result = ExportResult(path=str(namespace))
    if target.parallel_agnostic and tp_size is None:
        result.notes.append(
            "TP 1 layout written: this namespace is parallel-agnostic and does not record TP; "
            "an engine at TP N reads these files right only if they were written with --tp N"
        )
    block = int(target.group["tokens_per_block"])
    for record in snapshot.sequences:
        tokens = [int(token) for token in record.token_ids]
        hashes = prefix_hashes(tokens, block, seed)
        result.sequences += 1
        result.tokens_left_out += len(tokens) - len(hashes) * block
        if not hashes:
            continue
        keys, values = _sequence_words(snapshot, record.id, geometry, len(hashes) * block)
        for index, digest in enumerate(hashes):
            path = block_path(rank_dir, digest.hex())
            if path.exists():
                result.present.append(str(path))
                continue
            tokens_of = slice(index * block, (index + 1) * block)
            data = _encode(keys[:, tokens_of], values[:, tokens_of], order, file_bytes)
            _write_atomically(path, data)
            result.written.append(str(path))
    return result


def _check_fits(geometry: KVGeometry, target: VLLMFsNamespace) -> None:
    """Refuse, naming both sides, what the namespace cannot hold."""
    fields = target.fields
    mismatches = []
    if geometry.is_mla:
        mismatches.append("the snapshot is MLA: kvsnap writes standard attention only")
    for name in ("canonical_format", "replicated_layout"):
        if name in fields:
            mismatches.append(
                f"the namespace has {name} {fields[name]!r}: kvsnap writes vLLM's "
                "direct (per-worker) layout only"
            )
    group = target.group
    if len(group["layer_names"]) != geometry.num_layers:
        mismatches.append(
            f"layers: snapshot {geometry.num_layers}, namespace {len(group['layer_names'])}"
        )
    if fields["dtype"] != geometry.dtype:
        mismatches.append(f"dtype: snapshot {geometry.dtype}, namespace {fields['dtype']}")
    if fields["blocks_per_file"] != 1 or fields["tokens_per_hash"] != group["tokens_per_block"]:
        mismatches.append(
            f"blocks_per_file {fields['blocks_per_file']} and tokens_per_hash "
            f"{fields['tokens_per_hash']}: kvsnap writes one block per file, hashed per block"
        )
    heads = target.heads()
    if (
        not geometry.is_mla
        and heads is not None
        and heads
        != (
            geometry.num_kv_heads,
            geometry.head_dim,
        )
    ):
        mismatches.append(
            f"KV heads x head_dim: snapshot {geometry.num_kv_heads} x {geometry.head_dim}, "
            f"the namespace's model {heads[0]} x {heads[1]}"
        )
    if mismatches:
        raise IncompatibleSnapshotError(
            f"the snapshot does not fit the vLLM namespace {target.path.name}: "
            + "; ".join(mismatches)
        )
    tp = target.writer_tp()
    if not geometry.is_mla and geometry.num_kv_heads % tp:
        raise IncompatibleSnapshotError(
            f"{geometry.num_kv_heads} KV heads do not split over TP {tp}"
        )


def _sequence_words(
    snapshot: Snapshot, sequence_id: str, geometry: KVGeometry, tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """Every layer's first ``tokens`` keys and values of a sequence, ``(layers, tokens, heads,
    dim)`` arrays of unsigned words of the KV's element size."""
    words = _WORDS[geometry.element_size]
    keys: list[np.ndarray] = []
    values: list[np.ndarray] = []
    for layer in range(geometry.num_layers):
        for part, into in (("key", keys), ("value", values)):
            tensor = snapshot.sequence_kv(sequence_id, f"layers.{layer}.{part}")[:tokens]
            into.append(tensor.contiguous().view(torch.uint8).numpy().view(words))
    return np.stack(keys), np.stack(values)


def _encode(keys: np.ndarray, values: np.ndarray, order: FileOrder, file_bytes: int) -> bytes:
    """One block file: every element where ``order`` puts it, zero padding after."""
    data = np.zeros(file_bytes // keys.itemsize, dtype=keys.dtype)
    data[order.key] = keys
    data[order.value] = values
    return data.tobytes()


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``path`` and rename it, as vLLM does: a
    reader never sees a partial block file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}_kvsnap{os.getpid()}.tmp")
    try:
        with temporary.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def export_summary(result: ExportResult) -> Mapping[str, Sequence[str] | int | str]:
    """The result as the CLI's ``--json`` reports it."""
    return {
        "path": result.path,
        "written": len(result.written),
        "present": len(result.present),
        "sequences": result.sequences,
        "tokens_left_out": result.tokens_left_out,
        "notes": result.notes,
    }
