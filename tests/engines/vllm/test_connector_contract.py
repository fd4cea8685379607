"""KVSnapConnector against vLLM's own scheduler, the way vLLM tests its connectors.

``tests/support/vllm_contract_child.py`` runs, with the vLLM virtualenv's Python, a real v1
``Scheduler`` or ``AsyncScheduler`` whose connector is KVSnapConnector, a fake model runner that
drives the worker role as vLLM's does, and a fake model whose KV depends on the blocks before it
(KV computed on top of a wrong block is wrong). Every loaded block and, at the end, every stored
chunk is compared bit-exact with the KV the fake model computes from a clean start. Marked
``vllm``: skips without ``.venv-vllm`` (``scripts/setup_vllm_venv.sh``).

The scenario, per scheduler kind: engine 0 (sync) stores prompts P (three chunks) and Q
(sharing P's first chunk). Before engine 1 starts, one byte of KV data of P's second chunk is
flipped (its header and token ids still pass the scheduler's check under ``recompute``) and
P's third chunk is removed; engine 1 (the scheduler kind under test, ``recompute``) matches
P's first two chunks, the second fails its checksum in the worker, vLLM recomputes, and the
connector persists P again. Engine 2 (sync, vLLM's default ``fail`` policy) loads P and Q.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.vllm_contract import Refusal
from tests.support.vllm_worlds import Worlds

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", params=["sync", "async"])
def failed_load(request: pytest.FixtureRequest, vllm_worlds: Worlds) -> dict[str, Any]:
    """Engines 0-2 with engine 1 under the ``request.param`` scheduler (``vllm_contract.py``),
    built with this folder's other real-vLLM worlds."""
    return vllm_worlds.get(f"failed_load[{request.param}]")


def test_failed_load_never_stores_wrong_kv(failed_load: dict[str, Any]) -> None:
    """Item 1: the failed load is recomputed and no chunk computed from (or on top of) the
    blocks that failed is stored; a fresh engine then loads every block bit-exact."""
    first, damaged, fresh = failed_load["engines"]
    assert damaged["failed_blocks"], "the flipped chunk must fail its load in the worker"
    assert [load["failed"] > 0 for load in damaged["loads"]] == [True]
    assert all(load["exact"] for load in damaged["loads"]), damaged["loads"]
    chunks = failed_load["chunks"]
    assert len(chunks) == 4, chunks  # P's three chunks and Q's second
    assert [chunk["path"] for chunk in chunks if not chunk["exact"]] == []
    assert [load["blocks"] for load in fresh["loads"]] == [6, 2]  # P whole; Q past P's chunk
    assert all(load["exact"] and load["failed"] == 0 for load in fresh["loads"]), fresh["loads"]
    assert fresh["failed_blocks"] == []
    for engine in (first, damaged, fresh):
        assert set(engine["finished"].values()) == {"length"}, engine["finished"]


def test_block_accounting_returns_to_start(failed_load: dict[str, Any]) -> None:
    """Every block held for a save is freed once its copies are done: the pool ends where it
    started, in every engine."""
    assert [engine["free_blocks_restored"] for engine in failed_load["engines"]] == [True] * 3


def test_pending_block_frees_while_blocks_are_held(failed_load: dict[str, Any]) -> None:
    """Item 9: ``has_pending_block_frees()`` is true exactly while vLLM holds finished
    requests' blocks for their saves (so vLLM waits for them rather than preempting)."""
    samples = [sample for engine in failed_load["engines"] for sample in engine["held_vs_pending"]]
    assert any(held for held, _ in samples), "no step held blocks: the check would prove nothing"
    assert [(held, pending) for held, pending in samples if bool(held) != pending] == []


def test_best_effort_cache_labels_its_hits(failed_load: dict[str, Any]) -> None:
    """Items 7 and 8: vLLM reads ``requires_kv_delivery`` False (a best-effort cache), and
    labels every loaded token as a disk hit."""
    engines = failed_load["engines"]
    assert [engine["requires_kv_delivery"] for engine in engines] == [False] * 3
    sources = [source for engine in engines for source in engine["hit_sources"]]
    assert sources, "no hit was labelled"
    assert all(set(source) == {"disk"} and all(source.values()) for source in sources), sources


def test_sliding_window_models_are_refused_at_start(sliding_window_refusal: Refusal) -> None:
    """Item 2, on real vLLM (CPU): a model whose every layer uses a sliding window keeps
    vLLM's sliding-window cache (vLLM frees blocks behind the window during prefill), so the
    connector refuses it when the engine starts, in one line naming why."""
    done = sliding_window_refusal
    assert done.returncode != 0 and not done.wrote_output
    refusal = (
        "kvsnap.errors.LayoutError: KVSnapConnector does not support SlidingWindowSpec KV caches"
    )
    assert refusal in done.output
