"""Shared builders for the format and store tests: random sequences, metadata and KV pages."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvsnap import format as fmt
from kvsnap.layout import KVGeometry
from kvsnap.store import SnapshotInfo, SnapshotReader, SnapshotWriter

SOURCE = fmt.SourceInfo(
    engine="test-engine",
    engine_version="1.0",
    model_id="random/model",
    model_revision="abc123",
    model_fingerprint="0123456789abcdef0123456789abcdef",
)

#: Geometries the round trips cover: standard attention in bf16, fp16 with 32 KiB pages
#: (4096-multiples: O_DIRECT end to end), MLA in fp8, odd float32 pages that need padding,
#: and fp8 e5m2 with one KV head.
GEOMETRIES = {
    "bf16": KVGeometry(num_layers=3, block_size=4, dtype="bfloat16", num_kv_heads=2, head_dim=8),
    "f16-32k": KVGeometry(
        num_layers=2, block_size=16, dtype="float16", num_kv_heads=8, head_dim=128
    ),
    "mla-f8": KVGeometry(num_layers=2, block_size=8, dtype="float8_e4m3fn", latent_dim=72),
    "f32-odd": KVGeometry(
        num_layers=2,
        block_size=3,
        dtype="float32",
        num_kv_heads=3,
        head_dim=5,
        attention_types=("full", "sliding"),
    ),
    "f8e5m2-mqa": KVGeometry(
        num_layers=1, block_size=5, dtype="float8_e5m2", num_kv_heads=1, head_dim=16
    ),
}


def shared_prefix_tokens(
    rng: np.random.Generator, block_size: int, num_sequences: int = 4
) -> list[np.ndarray]:
    """Sequences sharing prefixes of random lengths (some exact duplicates, partial last blocks)."""
    base = rng.integers(0, 50_000, size=block_size * 6 + 3, dtype=np.int64)
    sequences = [base]
    for _ in range(num_sequences - 1):
        keep = int(rng.integers(0, len(base)))
        tail = rng.integers(
            0, 50_000, size=int(rng.integers(1, 2 * block_size + 2)), dtype=np.int64
        )
        sequences.append(np.concatenate([base[:keep], tail]))
    sequences.append(base[: block_size * 2])  # a prefix of another sequence: fully shared
    return sequences


def make_metadata(
    geometry: KVGeometry,
    token_lists: Sequence[np.ndarray],
    *,
    created: str | None = None,
    extra_blocks: int = 0,
) -> fmt.SnapshotMetadata:
    """Metadata as a capture builds it: hash chains, dedupe, one record per sequence.

    ``extra_blocks`` appends blocks no sequence references (a raw block dump).
    """
    chains = [fmt.prefix_hash_chain(tokens, geometry.block_size) for tokens in token_lists]
    dedupe = fmt.dedupe_blocks(chains)
    records = [
        fmt.SequenceRecord(f"seq-{index}", tokens, block_ids, tuple(chain))
        for index, (tokens, block_ids, chain) in enumerate(
            zip(token_lists, dedupe.sequence_block_ids, chains, strict=True)
        )
    ]
    return fmt.SnapshotMetadata(
        geometry=geometry,
        source=SOURCE,
        sequences=records,
        num_blocks=dedupe.num_blocks + extra_blocks,
        capture_encoding="test-layout",
        tp_size=1,
        created=created,
    )


def random_pages(rng: np.random.Generator, metadata: fmt.SnapshotMetadata) -> dict[str, np.ndarray]:
    """Random bytes for every layer tensor (NaN/Inf bit patterns included: bytes must survive)."""
    size = metadata.num_blocks * metadata.geometry.canonical_page_size_bytes
    return {
        name: rng.integers(0, 256, size=size, dtype=np.uint8)
        for name in metadata.geometry.tensor_names()
    }


def write_snapshot(
    path: object,
    metadata: fmt.SnapshotMetadata,
    pages: dict[str, np.ndarray],
    *,
    rng: np.random.Generator | None = None,
    **writer_options: object,
) -> SnapshotInfo:
    """Write ``pages`` through a :class:`SnapshotWriter`; in random chunk sizes with ``rng``."""
    page = metadata.geometry.canonical_page_size_bytes
    with SnapshotWriter(path, metadata, **writer_options) as writer:  # type: ignore[arg-type]
        for name in writer.tensor_order():
            data = pages[name]
            block = 0
            while block < metadata.num_blocks:
                count = metadata.num_blocks - block
                if rng is not None:
                    count = int(rng.integers(1, count + 1))
                writer.write_pages(name, data[block * page : (block + count) * page])
                block += count
    assert writer.info is not None
    return writer.info


def build(
    name: str, seed: int, **options: Any
) -> tuple[fmt.SnapshotMetadata, dict[str, np.ndarray]]:
    """Metadata of random sequences in ``GEOMETRIES[name]`` and random KV pages for them."""
    rng = np.random.default_rng(seed)
    geometry = GEOMETRIES[name]
    metadata = make_metadata(geometry, shared_prefix_tokens(rng, geometry.block_size), **options)
    return metadata, random_pages(rng, metadata)


def page_of(pages: np.ndarray, page_bytes: int, block: int) -> bytes:
    """The bytes of page ``block`` of one tensor's pages."""
    return pages[block * page_bytes : (block + 1) * page_bytes].tobytes()


def temp_files(directory: Path) -> list[str]:
    """The writers' temporary files in ``directory``, but for this process's spare capture
    files (``store/spare_files.py``: made in the background after a DMA capture, waited for
    here; :func:`spare_names` lists them)."""
    spares = set(spare_names(directory))
    return sorted(
        name for name in os.listdir(directory) if ".kvsnap-tmp-" in name and name not in spares
    )


def spare_names(directory: Path) -> list[str]:
    """The names of this process's spare capture files in ``directory``, once none is being
    made."""
    from kvsnap.store.spare_files import spare_files

    spare_files().wait()
    return sorted(
        os.path.basename(path)
        for path in spare_files().paths()
        if os.path.dirname(path) == os.path.abspath(directory)
    )


def write_mapped(
    path: object,
    metadata: fmt.SnapshotMetadata,
    pages: dict[str, np.ndarray],
    *,
    after_tensor: Any = None,
    **writer_options: object,
) -> SnapshotInfo:
    """Write ``pages`` as a capture from a CUDA cache into a memory-backed file does, with the
    host in the device's place: the files mapped (not registered), every tensor's pages copied
    to where ``page_placement`` says and reported with their xxh3-64 (``placed_slot``), and
    their BLAKE3 digests when the writer signs. ``after_tensor(index)`` runs after each tensor
    is placed."""
    page = metadata.geometry.canonical_page_size_bytes
    with SnapshotWriter(path, metadata, **writer_options) as writer:  # type: ignore[arg-type]
        refused = writer.map_for_device(register=False)
        assert refused is None, refused
        files = writer.mapped_files()
        for index, name in enumerate(writer.tensor_order()):
            shard, offset = writer.page_placement(name, 0)
            data = pages[name]
            files[shard][offset : offset + data.nbytes] = data
            bound = fmt.page_digests(data, page) if writer.wants_page_digests else None
            writer.placed_slot([(name, data.nbytes // page)], fmt.block_digests(data, page), bound)
            if after_tensor is not None:
                after_tensor(index)
        del files
    assert writer.info is not None
    return writer.info


def stored_and_actual_digests(path: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Per layer tensor, the xxh3-64 the file stores for its pages (checked against the
    trailer on the way) and the xxh3-64 of the pages' bytes as they are in the file."""
    data = path.read_bytes()
    stored, actual = [], []
    with SnapshotReader(path) as reader:
        page = reader.metadata.geometry.canonical_page_size_bytes
        for name in reader.layer_names:
            _, _, entry = reader.layer(name)
            body = data[entry.begin : entry.end]
            stored.append(reader.block_checksums(name).tolist())
            actual.append(
                [
                    xxhash.xxh3_64_intdigest(body[start : start + page])
                    for start in range(0, len(body), page)
                ]
            )
    return stored, actual


@contextlib.contextmanager
def mounted_tmpfs(size: str, prefix: str) -> Iterator[Path]:
    """A new tmpfs of ``size`` (``mount -o size=``) on a new directory, unmounted and removed
    afterwards; the test is skipped where mounting needs a root this process is not."""
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        directory.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=False)
        directory.rmdir()
