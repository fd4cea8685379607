"""Nodes of engines sharing a remote tier, for the tests of ``tests/engines/vllm/test_remote_*``.

A node is the connector's own scheduler and worker without vLLM on a local store of its own
(``benchmarks/store_soak.py``'s :class:`~benchmarks.store_soak.Engine`, with the connector's
options for the remote tier and its events kept), serving prompts whose KV is a function of
their tokens, every loaded block compared bit-exact with it. The remote tier is a real
S3-protocol server on loopback (moto) reached through a fault-injecting proxy
(``benchmarks/s3_loopback.py``), the standard way: ``AWS_ENDPOINT_URL_S3`` and credentials in
the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import store_soak
from kvsnap.engines.vllm import PrefixStore
from kvsnap.format.signing import KeyRing

BLOCK, CHUNK_BLOCKS, NAMESPACE = store_soak.BLOCK, store_soak.CHUNK_BLOCKS, store_soak.NAMESPACE


def make_node(
    root: Path, keys: KeyRing | None, url: str | None = None, **options: Any
) -> store_soak.Engine:
    """An engine on the local store ``root`` (created ``0700``), signing with ``keys``, with
    the remote tier ``url`` (none: a local store only) and more connector ``options``."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    extra = dict(options)
    if url is not None:
        extra = {"remote_url": url, "remote_deadline_s": 5.0, **extra}
    return store_soak.Engine(
        root, None, "fail", blocks=8, min_idle_s=0.0, extra=extra, keys=keys, keep_events=True
    )


def serve(node: store_soak.Engine, prompt: np.ndarray, request_id: str) -> dict[str, int]:
    """One request through ``node``: its counts (``loaded_blocks``, ``wrong_kv``,
    ``failed_loads``, ``saves``...); the saves are written, the uploads queued."""
    counts = dict.fromkeys(store_soak._COUNTS, 0)
    node.serve(request_id, prompt, counts)
    return counts


def prompts(seed: int, count: int) -> list[np.ndarray]:
    """``count`` prompts of 2 to 6 loadable blocks, no two sharing a block."""
    rng = np.random.default_rng(seed)
    return [
        rng.integers(1, 30000, size=BLOCK * int(rng.integers(2, 7)) + 5).astype(np.int64)
        for _ in range(count)
    ]


def loadable_blocks(prompt: np.ndarray) -> int:
    return (len(prompt) - 1) // BLOCK


def chunk_keys(prompt: np.ndarray) -> list[str]:
    """The store keys naming ``prompt``'s chunks (their last blocks'), in order."""
    from kvsnap.engines.vllm import CacheIdentity, store_key_chain

    blocks = loadable_blocks(prompt)
    chain = store_key_chain(prompt[: blocks * BLOCK], BLOCK, CacheIdentity())
    spans = PrefixStore("/nonexistent", NAMESPACE, CHUNK_BLOCKS).chunk_spans(blocks)
    return [chain[end - 1] for _, end in spans]


def object_name(bucket: str, prefix: str, key: str) -> str:
    """Where the chunk ``key`` lives in the bucket (the remote tier at ``s3://bucket/prefix``)."""
    return f"{bucket}/{prefix}/{NAMESPACE}/chunks/{key[:2]}/{key}.safetensors"


def local_chunk(node: store_soak.Engine, key: str) -> Path:
    return Path(node.scheduler.store.chunk_path(key))
