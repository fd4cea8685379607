"""A snapshot file changed by someone who can write it and compute every fast checksum, but has
no key: the xxh3-64 page checksums, the xxh3-128 trailer rows and the prefix hashes recomputed
from the changed bytes with nothing but the format's description (docs/format.md, "Checksums")
and xxhash, so that an unsigned reader finds the file intact."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import xxhash

from kvsnap import format as fmt


class RawSnapshot:
    """A snapshot file's bytes, its header's entries (absolute offsets) and its page size."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.raw = bytearray(path.read_bytes())
        (length,) = struct.unpack("<Q", self.raw[:8])
        header = json.loads(self.raw[8 : 8 + length])
        self.data_start = 8 + length
        self.metadata = json.loads(header.pop("__metadata__")["kvsnap"])
        self.entries = sorted(
            (
                self.data_start + spec["data_offsets"][0],
                self.data_start + spec["data_offsets"][1],
                name,
            )
            for name, spec in header.items()
        )
        self.num_blocks = int(self.metadata["num_blocks"])
        layers = [entry for entry in self.entries if entry[2].startswith("layers.")]
        self.page_bytes = (layers[0][1] - layers[0][0]) // self.num_blocks

    def span(self, name: str) -> tuple[int, int]:
        for begin, end, entry in self.entries:
            if entry == name:
                return begin, end
        raise KeyError(name)

    def array(self, name: str, dtype: str) -> np.ndarray:
        """Tensor ``name``'s bytes as a writable ``dtype`` view of the file's bytes."""
        begin, end = self.span(name)
        return np.frombuffer(memoryview(self.raw)[begin:end], dtype=dtype)

    def page(self, name: str, block: int) -> np.ndarray:
        """Block ``block`` of layer tensor ``name``, a writable view of the file's bytes."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} of {self.num_blocks}")
        begin, _ = self.span(name)
        start = begin + block * self.page_bytes
        return np.frombuffer(memoryview(self.raw)[start : start + self.page_bytes], np.uint8)

    def recompute_checksums(self) -> None:
        """Every page's xxh3-64, every trailer row and the trailer's own row, from the bytes."""
        layers = [name for _, _, name in self.entries if name.startswith("layers.")]
        table = self.array(fmt.BLOCK_CHECKSUMS_TENSOR, "<u8").reshape(len(layers), -1)
        for row, name in enumerate(layers):
            for block in range(self.num_blocks):
                table[row, block] = xxhash.xxh3_64_intdigest(self.page(name, block).tobytes())
        rows = [xxhash.xxh3_128_digest(bytes(self.raw[: self.data_start]))]
        for begin, end, name in self.entries:
            if name.startswith("kvsnap.padding.") or name in (
                fmt.CHECKSUMS_TENSOR,
                fmt.SIGNATURE_TENSOR,
            ):
                continue
            if name.startswith("layers."):
                row = table[layers.index(name)].astype("<u8").tobytes()
                rows.append(xxhash.xxh3_128_digest(row))
            else:
                rows.append(xxhash.xxh3_128_digest(bytes(self.raw[begin:end])))
        body = b"".join(rows)
        begin, end = self.span(fmt.CHECKSUMS_TENSOR)
        self.raw[begin:end] = body + xxhash.xxh3_128_digest(body)

    def recompute_prefix_hashes(self) -> None:
        """Every sequence's prefix hashes, from its token ids and block ids."""
        hashes = self.array(fmt.BLOCK_HASHES_TENSOR, np.uint8).reshape(-1, 16)
        block_size = int(self.metadata["layout"]["block_size"])
        for index in range(len(self.metadata["sequences"])):
            tokens = self.array(f"sequences.{index}.token_ids", "<i8")
            blocks = self.array(f"sequences.{index}.block_ids", "<i8")
            chain = fmt.prefix_hash_chain(tokens, block_size)
            for block, digest in zip(blocks.tolist(), chain, strict=True):
                hashes[block] = np.frombuffer(bytes.fromhex(digest), np.uint8)

    def save(self) -> None:
        self.path.write_bytes(bytes(self.raw))
