"""Write the committed samples of LMCache's multiprocess-server ``fs`` L2 under fixtures/foreign/.

Usage, with LMCache 0.5.6 installed without its dependencies into a folder of its own (a
CUDA serving extension: only its L2 storage, keys and token hasher run here)::

    pip install --no-deps --target SITE lmcache==0.5.6 aiofiles msgspec psutil pyzmq \\
        py-cpuinfo cachetools numba llvmlite
    PYTHONPATH=.:SITE .venv/bin/python scripts/make_lmcache_fixtures.py [OUT]

(default ``OUT``: ``fixtures/foreign/lmcache-fs``). The KV is the built-in tiny Llama's
(``kvsnap.engines.default_model``, bfloat16) prefill of a 96-token prompt, which kvsnap also
captures (``OUT/reference.safetensors``). At TP 1 and 2 (``OUT/tp<N>``), each rank's chunk of
32 tokens becomes the memory object LMCache's server keeps in L1 for an engine's KV,
``(2, layers, tokens, hidden)`` (``MemoryFormat.KV_2LTD``, this rank's heads), and LMCache's
own ``FSL2Adapter`` stores it under the ``ObjectKey`` of LMCache's own ``TokenHasher``
(blake3, the server's default) and ``ComputeKVRank``. The only thing replaced is the GPU copy
that fills the object from the engine's paged cache: a torch copy of the same rows.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 32
PROMPT_TOKENS = 96
MODEL_NAME = "kvsnap/tiny-llama"


def memory_object(kv: Any) -> Any:
    """An LMCache memory object over ``kv`` (2, layers, tokens, hidden)."""
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    flat = kv.contiguous().reshape(-1).view(kv.dtype)
    metadata = MemoryObjMetadata(
        shape=kv.shape,
        dtype=kv.dtype,
        address=0,
        phy_size=flat.numel() * flat.element_size(),
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
    )
    return TensorMemoryObj(flat, metadata, None)


def store(out: Path, keys: list[Any], values: list[Any], tokens: list[int], tp: int) -> None:
    """Every rank of a TP ``tp`` deployment storing the prompt's chunks through the fs L2."""
    import torch
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    hashes = TokenHasher(chunk_size=CHUNK, hash_algorithm="blake3").compute_chunk_hashes(tokens)
    adapter = FSL2Adapter(FSL2AdapterConfig(base_path=str(out)))
    heads = keys[0].shape[1] // tp
    try:
        for rank in range(tp):
            part = slice(rank * heads, (rank + 1) * heads)
            objects, object_keys = [], []
            for index, digest in enumerate(hashes):
                rows = slice(index * CHUNK, (index + 1) * CHUNK)
                # What LMCache's GPU connector gathers from the paged cache: per layer this
                # chunk's token rows of K and of V, heads flattened into the hidden axis.
                kv = torch.stack(
                    [
                        torch.stack([k[rows, part].flatten(1) for k in keys]),
                        torch.stack([v[rows, part].flatten(1) for v in values]),
                    ]
                )
                objects.append(memory_object(kv))
                kv_rank = ObjectKey.ComputeKVRank(tp, rank, tp, rank)
                object_keys.append(ObjectKey(digest, MODEL_NAME, kv_rank))
            task = adapter.submit_store_task(object_keys, objects)
            _wait(adapter, task)
    finally:
        adapter.close()


def _wait(adapter: Any, task: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = adapter.pop_completed_store_tasks()
        if task in done:
            assert done[task].success if hasattr(done[task], "success") else done[task]
            return
        time.sleep(0.01)
    raise SystemExit("the fs L2 store did not finish")


def main(out: Path) -> None:
    import lmcache
    import numpy as np
    import torch

    from kvsnap.engines import transformers as kt
    from kvsnap.engines.default_model import load_model

    model = load_model(dtype=torch.bfloat16)
    tokens = [256, *np.random.default_rng(56).integers(0, 256, PROMPT_TOKENS - 1).tolist()]
    [(cache, ids)] = kt.prefill_token_ids(model, [tokens])
    keys = [layer.keys[0].transpose(0, 1).contiguous() for layer in cache.layers]
    values = [layer.values[0].transpose(0, 1).contiguous() for layer in cache.layers]
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    kt.capture_dynamic_cache(
        cache, [ids], out / "reference.safetensors", model=model, reproducible=True
    )
    config = model.model.config.to_dict()
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "prompt.json").write_text(json.dumps(ids) + "\n")
    for tp in (1, 2):
        store(out / f"tp{tp}", keys, values, ids, tp)
    versions = {"lmcache": lmcache.__version__, "torch": torch.__version__}
    (out / "versions.json").write_text(json.dumps(versions) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "fixtures" / "foreign" / "lmcache-fs")
