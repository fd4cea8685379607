"""Writing one sequence of a kvsnap snapshot as a llama.cpp sequence state file.

The file is what ``llama_state_seq_save_file`` writes (magic ``ggsq``, version 3; layout in
``llama_state.py`` and docs/foreign.md): the sequence's token ids, one stream of one cell per
token at positions ``0..n-1`` in sequence 0, then every layer's key rows and value rows (or,
``v_transposed``, the value cache transposed as llama.cpp keeps it without flash attention).
``llama_state_seq_load_file`` loads it into a context of the same model, which then continues
from the last token.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from kvsnap.errors import IncompatibleSnapshotError
from kvsnap.format import SequenceRecord
from kvsnap.snapshot import Snapshot

from .llama_state import SEQ_MAGIC, VERSIONS

#: ggml type ids of the dtypes kvsnap writes.
GGML_TYPE_IDS = {"float32": 0, "float16": 1, "bfloat16": 30}


def export_llama_state(
    snapshot: Snapshot,
    output: str | Path,
    *,
    sequence_id: str | None = None,
    v_transposed: bool = False,
    hf_rope: bool = False,
) -> int:
    """Write sequence ``sequence_id`` (default: the snapshot's only one) of ``snapshot`` to
    ``output`` as a llama.cpp sequence state; returns the number of tokens written.

    ``hf_rope``: the keys come from a transformers model, whose rotary embedding pairs
    dimension ``i`` with ``i + head_dim / 2``; llama.cpp, whose converted weights pair
    ``2i`` with ``2i + 1``, keeps each head's key dimensions in that interleaved order, so they
    are reordered (values are not rotated and keep their order).

    Raises :class:`~kvsnap.errors.IncompatibleSnapshotError` for what the format cannot hold
    (MLA, a dtype without a ggml type), and ``ValueError`` when the sequence is not named
    and the snapshot holds several.
    """
    geometry = snapshot.geometry
    if geometry.is_mla:
        raise IncompatibleSnapshotError("the snapshot is MLA: llama.cpp state files hold K and V")
    if geometry.dtype not in GGML_TYPE_IDS:
        raise IncompatibleSnapshotError(
            f"dtype {geometry.dtype}: llama.cpp state files hold {', '.join(GGML_TYPE_IDS)} KV"
        )
    record = _one_sequence(snapshot, sequence_id)
    tokens = np.asarray(record.token_ids, dtype="<i4")
    kind = GGML_TYPE_IDS[geometry.dtype]
    row_elements = geometry.num_kv_heads * geometry.head_dim
    path = Path(output)
    temporary = path.with_name(f".{path.name}.kvsnap{os.getpid()}.tmp")
    try:
        with temporary.open("wb") as handle:
            _write_header(handle, tokens)
            keys = [
                _rows(snapshot, record.id, layer, "key") for layer in range(geometry.num_layers)
            ]
            if hf_rope:
                keys = [_interleave_halves(rows, geometry.head_dim) for rows in keys]
            handle.write(struct.pack("<II", int(v_transposed), geometry.num_layers))
            for rows in keys:
                handle.write(struct.pack("<iQ", kind, row_elements * geometry.element_size))
                handle.write(rows.tobytes())
            for layer in range(geometry.num_layers):
                rows = _rows(snapshot, record.id, layer, "value")
                if v_transposed:
                    handle.write(struct.pack("<iII", kind, geometry.element_size, row_elements))
                    handle.write(np.ascontiguousarray(rows.T).tobytes())
                else:
                    handle.write(struct.pack("<iQ", kind, row_elements * geometry.element_size))
                    handle.write(rows.tobytes())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return len(tokens)


def _one_sequence(snapshot: Snapshot, sequence_id: str | None) -> SequenceRecord:
    if sequence_id is not None:
        return snapshot.sequence(sequence_id)
    records = snapshot.sequences
    if len(records) != 1:
        names = ", ".join(record.id for record in records[:8])
        raise ValueError(
            f"the snapshot holds {len(records)} sequences ({names}): a llama.cpp sequence "
            "state holds one, name it with --sequence"
        )
    return records[0]


def _write_header(handle: BinaryIO, tokens: np.ndarray) -> None:
    """Magic, version, the tokens, one stream of one cell per token in sequence 0."""
    count = len(tokens)
    handle.write(struct.pack("<III", SEQ_MAGIC, VERSIONS[SEQ_MAGIC], count))
    handle.write(tokens.tobytes())
    handle.write(struct.pack("<II", 1, count))
    cells = np.zeros((count, 3), dtype="<i4")
    cells[:, 0] = np.arange(count)  # position
    cells[:, 1] = 1  # one sequence id per cell: sequence 0
    handle.write(cells.tobytes())


def _interleave_halves(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Each head's ``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]`` as ``[x_0, y_0, x_1, y_1, ...]``."""
    if head_dim % 2:
        raise IncompatibleSnapshotError(f"head_dim {head_dim} is odd: no rotary halves")
    tokens = rows.shape[0]
    halves = rows.reshape(tokens, -1, 2, head_dim // 2)
    return np.ascontiguousarray(halves.transpose(0, 1, 3, 2)).reshape(tokens, -1)


def _rows(snapshot: Snapshot, sequence_id: str, layer: int, part: str) -> np.ndarray:
    """One layer's K or V of a sequence as ``(tokens, heads * head_dim)`` words."""
    tensor = snapshot.sequence_kv(sequence_id, f"layers.{layer}.{part}")
    words = {1: np.uint8, 2: np.uint16, 4: np.uint32}[tensor.element_size()]
    flat = tensor.contiguous().view(torch.uint8).numpy().view(words)
    return flat.reshape(tensor.shape[0], -1)
