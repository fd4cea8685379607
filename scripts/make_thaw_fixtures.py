"""Write the committed sample of a thaw KV snapshot under fixtures/foreign/thaw/.

Usage, with thaw-vllm 0.6.0 installed without its dependencies into a folder of its own, run
by ``.venv-vllm`` (real vLLM, for its block hashes and blocks)::

    pip install --no-deps --target SITE thaw-vllm==0.6.0
    PYTHONPATH=.:SITE .venv-vllm/bin/python scripts/make_thaw_fixtures.py [OUT]

(it sets ``THAW_ALLOW_PYTHON_FALLBACK=1``, thaw's own switch for its Python writer)

(default ``OUT``: ``fixtures/foreign/thaw``). The KV is the built-in tiny Llama's
(``kvsnap.engines.default_model``, bfloat16) prefill of a 48-token prompt, which kvsnap also
captures (``OUT/reference.safetensors``), laid into vLLM's cache layout (per layer ``(2,
blocks, 16, heads, head_dim)``) at shuffled block ids. thaw's own ``freeze_kv_cache`` freezes
it: it walks a vLLM engine's block pool for the blocks vLLM's prefix cache hashed (real
``KVCacheBlock`` objects, hashed by vLLM's own ``hash_block_tokens`` with its ``sha256`` and
group id) and the model runner's ``kv_caches``, the two things it reads of the engine. Without
thaw's Rust extension (``thaw-native``, a CUDA build) thaw takes its pure-Python path, the
legacy single-file format; on this CPU machine its pinned staging buffer is plain memory and
its ``torch.cuda.synchronize()`` a no-op (the only things replaced).
"""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
PROMPT_TOKENS = 48
NUM_BLOCKS = 10


def _cpu_only_torch() -> None:
    """Pinned memory and CUDA syncs, which a CPU-only torch refuses, as their CPU meaning."""
    import torch

    empty = torch.empty

    def host_empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return empty(*args, **kwargs)

    torch.empty = host_empty
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.is_pinned = lambda self, *args, **kwargs: True


def engine(kv_caches: list[Any], block_ids: list[int], tokens: list[int]) -> Any:
    """The parts of a vLLM ``LLM`` thaw reads: its block pool (real ``KVCacheBlock``s with
    vLLM's prefix-cache hashes) and the model runner's caches."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    blocks = [KVCacheBlock(block_id) for block_id in range(NUM_BLOCKS)]
    parent = kv_cache_utils.NONE_HASH
    for index, block_id in enumerate(block_ids):
        chunk = tokens[index * BLOCK : (index + 1) * BLOCK]
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, chunk, None)
        blocks[block_id].set_block_hash(make_block_hash_with_group_id(parent, 0), BLOCK)
    scheduler = types.SimpleNamespace(
        kv_cache_manager=types.SimpleNamespace(block_pool=types.SimpleNamespace(blocks=blocks)),
        block_size=BLOCK,
    )
    runner = types.SimpleNamespace(kv_caches=kv_caches)
    core = types.SimpleNamespace(
        scheduler=scheduler,
        model_executor=types.SimpleNamespace(
            driver_worker=types.SimpleNamespace(model_runner=runner)
        ),
    )
    return types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=core))


def main(out: Path) -> None:
    import numpy as np
    import torch

    from kvsnap.engines import transformers as kt
    from kvsnap.engines.default_model import load_model

    model = load_model(dtype=torch.bfloat16)
    tokens = [256, *np.random.default_rng(48).integers(0, 256, PROMPT_TOKENS - 1).tolist()]
    [(cache, ids)] = kt.prefill_token_ids(model, [tokens])
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    kt.capture_dynamic_cache(
        cache, [ids], out / "reference.safetensors", model=model, reproducible=True
    )
    block_ids = [7, 2, 5]
    kv_caches = []
    for layer in cache.layers:
        heads, dim = layer.keys.shape[1], layer.keys.shape[3]
        kv = torch.zeros(2, NUM_BLOCKS, BLOCK, heads, dim, dtype=torch.bfloat16)
        for part, tensor in enumerate((layer.keys[0], layer.values[0])):
            pages = tensor.transpose(0, 1).reshape(len(block_ids), BLOCK, heads, dim)
            kv[part, block_ids] = pages
        kv_caches.append(kv)
    _cpu_only_torch()
    import os

    os.environ["THAW_ALLOW_PYTHON_FALLBACK"] = "1"  # thaw's own switch for its Python path
    from thaw_vllm.kv_snapshot import freeze_kv_cache

    stats = freeze_kv_cache(engine(kv_caches, block_ids, ids), str(out / "prefix.thawkv"))
    assert stats["num_blocks"] == len(block_ids), stats
    (out / "prompt.json").write_text(json.dumps(ids) + "\n")
    from importlib.metadata import version

    import vllm

    versions = {"thaw-vllm": version("thaw-vllm"), "vllm": vllm.__version__}
    (out / "versions.json").write_text(json.dumps(versions) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "fixtures" / "foreign" / "thaw")
