"""The decoding recipe of docs/format.md's "Encoded snapshots" section (numpy, zstandard and
xxhash only), executed from the doc itself: an independent decoder for the tests; and the whole
decoded file rebuilt from that recipe and the doc's text, without kvsnap."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import xxhash

DOC = Path(__file__).resolve().parents[2] / "docs" / "format.md"


def doc_recipe() -> dict:
    """The names the Python block of the doc's "Encoded snapshots" section defines."""
    section = DOC.read_text().split("## Encoded snapshots", 1)[1].split("\n## ", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)  # the doc's own code, nothing of kvsnap's
    return scope


#: Layer tensor dtypes fp8 pages decode into, as numpy types (bfloat16: its bits).
FP8_DECODED = {"BF16": None, "F16": np.float16, "F32": np.float32}


def decoded_file(path: Path) -> bytes:
    """The decoded file of the encoded snapshot at ``path``, rebuilt from docs/format.md alone:
    the recipe decodes the tensors ("Encoded snapshots"), the original header places them (its
    padding zero), and for ``fp8`` the page checksums and trailer are computed for the decoded
    pages as "Checksums" says. No kvsnap code runs."""
    recipe = doc_recipe()
    meta, stored_header, data = recipe["tensors"](path)
    header_bytes = data["kvsnap.original_header"].tobytes()
    (length,) = struct.unpack("<Q", header_bytes[:8])
    entries = json.loads(header_bytes[8 : 8 + length])
    entries.pop("__metadata__")
    out = bytearray(meta["encoding"]["decoded_bytes"])
    out[: len(header_bytes)] = header_bytes
    start = len(header_bytes)
    kinds = meta["encoding"]["tensors"]
    for name, spec in entries.items():
        if name.startswith("kvsnap.padding."):
            continue
        begin, end = (start + offset for offset in spec["data_offsets"])
        kind = kinds.get(name, "raw")
        if kind == "raw":
            out[begin:end] = data[name].tobytes()
        elif kind == "lossless":
            word = {"BF16": 2, "F16": 2, "F32": 4}[spec["dtype"]]
            table = data[name + ".chunks"].view("<u8")
            pages = recipe["lossless_pages"](
                data[name], table, spec["shape"][0], (end - begin) // spec["shape"][0], word
            )
            out[begin:end] = pages.tobytes()
        else:
            out[begin:end] = fp8_pages(recipe, stored_header, data, name, spec["dtype"])
    if "fp8" in kinds.values():
        _checksums_for_pages(out, entries, start)
    return bytes(out)


def fp8_pages(recipe: dict, header: dict, data: dict, name: str, dtype: str) -> bytes:
    """Layer tensor ``name``'s e4m3 values and scales decoded by the recipe into ``dtype``."""
    shape = header[name]["shape"]
    codes = data[name].reshape(shape[0], shape[1], -1, shape[-1])  # MLA: one head
    scales = data[name + ".scales"].view("<f4").reshape(header[name + ".scales"]["shape"])
    numpy_type = FP8_DECODED[dtype]
    if numpy_type is None:
        return recipe["fp8_to_bf16_bits"](codes, scales).astype("<u2").tobytes()
    return recipe["fp8_to_float"](codes, scales, numpy_type).tobytes()


def _checksums_for_pages(out: bytearray, entries: dict, start: int) -> None:
    """docs/format.md "Checksums": each layer tensor's pages' xxh3-64 in
    ``kvsnap.block_checksums`` (rows in file order), then the trailer: the header's xxh3-128,
    one row per tensor in file order (a layer tensor: of its row of page checksums; padding
    and the trailer left out), and the xxh3-128 of the rows before it."""

    def place(name: str) -> tuple[int, int]:
        begin, end = entries[name]["data_offsets"]
        return start + begin, start + end

    layers = [name for name in entries if name.startswith("layers.")]
    rows = {}
    for name in layers:
        begin, end = place(name)
        page = (end - begin) // entries[name]["shape"][0]
        digests = [
            xxhash.xxh3_64_intdigest(bytes(out[at : at + page])) for at in range(begin, end, page)
        ]
        rows[name] = np.array(digests, dtype="<u8").tobytes()
    begin, end = place("kvsnap.block_checksums")
    out[begin:end] = b"".join(rows[name] for name in layers)
    trailer = [xxhash.xxh3_128_digest(bytes(out[:start]))]
    for name in entries:
        if name.startswith("kvsnap.padding.") or name == "kvsnap.checksums":
            continue
        begin, end = place(name)
        held = rows[name] if name in rows else bytes(out[begin:end])
        trailer.append(xxhash.xxh3_128_digest(held))
    trailer.append(xxhash.xxh3_128_digest(b"".join(trailer)))
    begin, end = place("kvsnap.checksums")
    out[begin:end] = b"".join(trailer)
