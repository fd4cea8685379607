"""Child process of tests/encoded/test_direct_capture_gpu.py: an encoded capture from host
caches with CUDA hidden (``CUDA_VISIBLE_DEVICES=""``), so that its pages are quantized and its
error measured on the CPU; the test compares it with the same capture from CUDA caches.

``python -m tests.support.cpu_encoded_capture_child CASE`` (from the repository root), ``CASE``
a JSON object: ``content`` (``"built-in"`` or ``"wide"``), ``kind``, ``dtype``
(``"bfloat16"``...), ``tp_size``, ``signed``, ``compression`` and ``out`` (the file to write).
Prints ``{"cuda": false}`` once written (torch saw no GPU).
"""

from __future__ import annotations

import json
import sys

import torch

import kvsnap
from kvsnap.format.signing import KeyRing
from tests.support.encoded_files import content_named, filled_caches, real_sequences

KEY = KeyRing([bytes(range(32))])


def main(case: dict) -> None:
    dtype = getattr(torch, case["dtype"])
    content = content_named(case["content"], dtype, case["kind"])
    caches = filled_caches(content, case["kind"], case["tp_size"])
    kvsnap.capture(
        [cache.layout for cache in caches],
        real_sequences(),
        case["out"],
        reproducible=True,
        keys=KEY if case["signed"] else None,
        compression=case["compression"],
    )
    print(json.dumps({"cuda": torch.cuda.is_available()}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
