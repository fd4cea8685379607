"""Child process of ``tests/transfer/test_page_blake3.py``: runs the device BLAKE3 kernel under
Triton's interpreter, which must be chosen before Triton is imported (the kernel's helpers are
made at import).

``TRITON_INTERPRET=1 python -m tests.support.blake3_interpreted_child CASES`` (from the
repository root). ``CASES`` is a JSON list of ``{"page_bytes", "count", "seed", "shape"}``
(``shape``: ``[chunk_lanes, pages_per_program, num_warps, row_loads]`` or null for the
default), each with optional ``"flips"`` (``[page, byte]`` pairs to flip in the buffer) and
``"stored_flips"`` (``[page, word]`` pairs to change in the stored digests); a case with
either runs the check launch against the host digests of the unaltered pages. Prints one JSON
list: per case, the digests (``count`` x 8 int32) or the check's flags.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from kvsnap.transfer import page_blake3
from tests.support.blake3_pages import host_digests, scattered_pages


def run_case(case: dict[str, Any]) -> list[Any]:
    page_bytes, count = case["page_bytes"], case["count"]
    buffer, words, pages = scattered_pages(page_bytes, count, case["seed"])
    shape = page_blake3.KernelShape(*case["shape"]) if case.get("shape") else None
    if "flips" not in case and "stored_flips" not in case:
        digests = torch.full((count, 8), 7, dtype=torch.int32)
        page_blake3.launch_page_blake3_at_words(buffer, words, page_bytes, digests, shape)
        return digests.tolist()
    stored = host_digests(pages)
    for page, position in case.get("flips", []):
        buffer[8 * int(words[page]) + position] ^= 0x10
    for page, word in case.get("stored_flips", []):
        stored[page, word] ^= 1
    page_ok = torch.full((count,), 7, dtype=torch.int64)
    page_blake3.launch_page_blake3_checks_at_words(
        buffer, words, page_bytes, torch.from_numpy(stored), page_ok, shape
    )
    return page_ok.tolist()


if __name__ == "__main__":
    print(json.dumps([run_case(case) for case in json.loads(sys.argv[1])]))
