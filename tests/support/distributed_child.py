"""Child processes of the distributed tests: one TP rank each, joined by a gloo group, and
``run_ranks``, which the parent test calls to start a group of them and collect their reports.

Every rank builds the same model content from one seed (the TP=1 canonical pages, random bytes)
and allocates its own rank's cache of it, the way a TP engine holds its heads; the parent
rebuilds the content to check what the ranks wrote and restored. Runs under multiprocessing's
spawn, so each child is a fresh interpreter like a ``torchrun`` rank.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kvsnap import distributed
from kvsnap.errors import RestoreIncompleteError
from kvsnap.layout import KVGeometry
from kvsnap.pipeline import SequenceBlocks
from kvsnap.testing.caches import (
    KVContent,
    SyntheticCache,
    make_cache,
    random_content,
    same_bytes,
)

#: Seconds a collective waits for a lost peer before it fails.
GROUP_TIMEOUT_S = 30


@dataclass(frozen=True)
class Case:
    """One model's cache at one TP size: what every rank (and the parent) rebuilds."""

    kind: str = "vllm-nhd"
    num_layers: int = 3
    num_kv_heads: int = 4
    head_dim: int = 16
    block_size: int = 4
    num_blocks: int = 24
    seed: int = 0
    #: MLA models (``kind="mla"``) hold a latent of this size instead of heads.
    latent_dim: int = 0
    #: Where each rank's cache lives (``"cuda"``: the rank's own GPU, or GPU 0 if it is alone).
    device: str = "cpu"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float16

    def geometry(self) -> KVGeometry:
        if self.latent_dim:
            return KVGeometry(
                num_layers=self.num_layers,
                num_kv_heads=0,
                head_dim=0,
                latent_dim=self.latent_dim,
                block_size=self.block_size,
                dtype="float16",
            )
        return KVGeometry(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype="float16",
        )

    def content(self) -> KVContent:
        generator = torch.Generator().manual_seed(self.seed)
        return random_content(self.geometry(), self.num_blocks, generator)

    def cache(self, tp_rank: int, tp_size: int) -> SyntheticCache:
        return make_cache(
            self.kind,
            num_layers=self.num_layers,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_kv_heads=0 if self.latent_dim else self.num_kv_heads,
            head_dim=0 if self.latent_dim else self.head_dim,
            latent_dim=self.latent_dim,
            dtype=self.dtype,
            tp_rank=tp_rank,
            tp_size=tp_size,
            device=self.rank_device(tp_rank),
        )

    def rank_device(self, rank: int) -> torch.device:
        if self.device != "cuda":
            return torch.device(self.device)
        return torch.device("cuda", rank % torch.cuda.device_count())

    def device_blocks(self) -> np.ndarray:
        """Where the content's pages sit in every rank's cache (a permutation: engines scatter)."""
        return np.random.default_rng(self.seed + 1).permutation(self.num_blocks)

    def sequences(self) -> list[SequenceBlocks]:
        """Two sequences over the content's blocks, the second ending in a partial block."""
        blocks = self.device_blocks()
        rng = np.random.default_rng(self.seed + 2)
        half = self.num_blocks // 2
        first = rng.integers(0, 32000, half * self.block_size)
        second = rng.integers(0, 32000, (self.num_blocks - half) * self.block_size - 1)
        return [
            SequenceBlocks("first", first, blocks[:half]),
            SequenceBlocks("second", second, blocks[half:]),
        ]


def join_group(rank: int, world: int, rendezvous: str) -> None:
    """Join the gloo group of ``world`` ranks through the rendezvous file."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )


def run_rank(rank: int, world: int, job: dict[str, Any]) -> None:
    """One rank of ``job["role"]``; writes what it saw to ``job["out"]/rank{rank}.json``."""
    out = Path(job["out"])
    join_group(rank, world, job["rendezvous"])
    case = Case(**job.get("case", {}))
    report: dict[str, Any] = {"rank": rank}
    try:
        if job["role"] == "capture":
            report.update(_capture(case, rank, world, job))
        elif job["role"] == "restore":
            report.update(_restore(case, rank, world, job))
        elif job["role"] == "worker-save":
            report.update(_worker_save(rank, world, job))
        elif job["role"] == "worker-shutdown":
            report.update(_worker_shutdown(rank, world, job))
        else:
            raise ValueError(f"unknown role {job['role']!r}")
    except Exception as error:  # reported to the parent, which asserts on it
        report["error"] = f"{type(error).__name__}: {error}"
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


#: Seconds the parent waits for a group of ranks before it calls the run hung.
JOIN_TIMEOUT_S = 120


def run_ranks(tmp: Path, role: str, world: int, path: Path, **job: Any) -> list[dict[str, Any]]:
    """Run ``world`` ranks of ``role``; their reports, rank by rank (``None`` for a dead rank)."""
    out = tmp / f"{role}-{world}-{os.urandom(4).hex()}"
    out.mkdir()
    job = {"role": role, "path": str(path), "out": str(out), "rendezvous": str(out / "rdv"), **job}
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=run_rank, args=(rank, world, job)) for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            raise AssertionError(f"a rank of {role} hung")
    reports = []
    for rank in range(world):
        report = out / f"rank{rank}.json"
        reports.append(json.loads(report.read_text()) if report.exists() else None)
    return reports


def _capture(case: Case, rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    cache = case.cache(rank, world)
    cache.fill(case.content(), torch.from_numpy(case.device_blocks()))
    trace = None
    if job.get("die_on_rank") == rank:

        def trace(kind: str, started: float, finished: float, nbytes: int) -> None:
            if kind.startswith("writer"):  # pages of this rank's part are being written: die
                os.kill(os.getpid(), signal.SIGKILL)

    result = distributed.capture(cache.layout, case.sequences(), job["path"], trace=trace)
    return {
        "num_bytes": result.num_bytes,
        "num_parts": result.num_parts,
        "part_bytes": None if result.written is None else result.written.num_bytes,
        "part_path": None if result.written is None else result.written.path,
    }


def _restore(case: Case, rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    cache = case.cache(rank, world)
    target = np.random.default_rng(case.seed + 7).permutation(case.num_blocks)
    block_ids = {}
    for sequence in case.sequences():
        block_ids[sequence.id] = target[: len(sequence.block_ids)]
        target = target[len(sequence.block_ids) :]
    report: dict[str, Any] = {"error": None, "failed_block_ids": []}
    try:
        distributed.restore(job["path"], cache.layout, block_ids)
    except RestoreIncompleteError as error:
        report["error"] = f"{type(error).__name__}: {error}"
        report["failed_block_ids"] = sorted(int(block) for block in error.failed_block_ids)
    content = case.content()
    mismatched = []
    for position, sequence_blocks in enumerate(_stored_order(case, block_ids)):
        source, destination = sequence_blocks
        for name in content.pages:
            expected = cache.expected(content, name, torch.as_tensor(source))
            actual = cache.logical(name)[torch.as_tensor(destination)]
            if not same_bytes(expected, actual):
                mismatched.append(f"{position}:{name}")
    return {**report, "mismatched": mismatched}


def _stored_order(
    case: Case, block_ids: dict[str, np.ndarray]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sequence: (content page indices, target blocks) the restore must have written."""
    inverse = np.argsort(case.device_blocks())
    return [
        (inverse[sequence.block_ids], np.asarray(block_ids[sequence.id]))
        for sequence in case.sequences()
    ]


# --------------------------------------------------------------------------------------------
# The vLLM connector's worker at TP > 1 (no vLLM needed: the worker takes a registered cache)

WORKER_BLOCK, WORKER_HEADS, WORKER_HEAD_DIM, WORKER_LAYERS, WORKER_BLOCKS = 4, 4, 8, 2, 16
WORKER_CHUNK_BLOCKS = 2
WORKER_FINGERPRINT = "cd" * 16


def worker_cells(seed: int = 0) -> list[torch.Tensor]:
    """Every head of a FLASH_ATTN cache, per layer ``[blocks, tokens, heads, 2*head_dim]``
    (each (token, head) cell is key ‖ value): what the TP ranks split between them."""
    generator = torch.Generator().manual_seed(seed)
    shape = (WORKER_BLOCKS, WORKER_BLOCK, WORKER_HEADS, 2 * WORKER_HEAD_DIM)
    return [
        torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(WORKER_LAYERS)
    ]


def worker_for(
    store_path: str,
    cells: list[torch.Tensor],
    rank: int,
    tp: int,
    group: Any,
    extra: dict[str, Any] | None = None,
) -> Any:
    """A connector worker over this rank's heads of ``cells`` (a copy it owns); ``extra``: more
    connector options."""
    from kvsnap.engines.vllm import ConnectorOptions, EventLog, PrefixStore
    from kvsnap.engines.vllm.registration import registered_cache
    from kvsnap.engines.vllm.worker import KVSnapWorker
    from kvsnap.format import SourceInfo

    per_rank = WORKER_HEADS // tp
    mine = [layer[:, :, rank * per_rank : (rank + 1) * per_rank].contiguous() for layer in cells]
    options = ConnectorOptions.from_extra_config(
        {"path": store_path, "chunk_blocks": WORKER_CHUNK_BLOCKS, **(extra or {})}
    )
    store = PrefixStore(options.path, "ns", chunk_blocks=WORKER_CHUNK_BLOCKS)
    source = SourceInfo("vllm", "test", "synthetic", None, WORKER_FINGERPRINT)
    worker = KVSnapWorker(
        options,
        store,
        EventLog(options.event_log, "worker", rank),
        vllm_config=None,
        fingerprint=WORKER_FINGERPRINT,
        source=source,
    )
    cache = registered_cache(
        [tensor.permute(0, 2, 1, 3) for tensor in mine],
        backend="FLASH_ATTN",
        kv_cache_layout="LBNHC",
        head_size=WORKER_HEAD_DIM,
        num_kv_heads=WORKER_HEADS,
        tp_rank=rank,
        tp_size=tp,
    )
    worker.attach(cache, group=group)
    return worker


def worker_saves(worker: Any, blocks: list[int], request: str) -> list[Any]:
    """The chunk saves of a prompt held in ``blocks``, as the scheduler plans them."""
    from kvsnap.engines.vllm import CacheIdentity, SaveSpec, chunk_sequence_id, store_key_chain

    tokens = np.random.default_rng(sum(blocks)).integers(1, 500, len(blocks) * WORKER_BLOCK)
    chain = store_key_chain(tokens, WORKER_BLOCK, CacheIdentity())
    ids = np.asarray(blocks, dtype=np.int64)
    return [
        SaveSpec(
            request_id=request,
            kind="persist",
            path=str(worker.store.chunk_path(chain[end - 1])),
            token_ids=tokens[start * WORKER_BLOCK : end * WORKER_BLOCK],
            block_ids=ids[start:end],
            sequence_id=chunk_sequence_id(
                start, chain[start - 1] if start else None, chain[end - 1]
            ),
        )
        for start, end in worker.store.chunk_spans(len(blocks))
    ]


def _worker_save(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    from kvsnap.engines.vllm import KVSnapConnectorMetadata

    worker = worker_for(job["path"], worker_cells(), rank, world, dist.group.WORLD)
    saves = worker_saves(worker, job["blocks"], "r1")
    worker.wait_for_save(KVSnapConnectorMetadata(saves=saves))
    worker.wait_for_writes()
    finished = worker.get_finished({"r1"})[0]
    first_files = sorted(str(p) for p in Path(job["path"]).rglob("*") if p.is_file())
    # The same chunks again (another request with the same prompt): stored, so never written.
    worker.wait_for_save(KVSnapConnectorMetadata(saves=worker_saves(worker, job["blocks"], "r2")))
    worker.wait_for_writes()
    worker.shutdown()
    return {
        "paths": [save.path for save in saves],
        "finished": sorted(finished or []),
        "first_files": first_files,
    }


def _worker_shutdown(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Queue ``job["requests"]`` requests' chunk saves on a store whose every ``fsync`` waits
    ``job["fsync_delay_s"]``, then shut the worker down at once, its drain bound
    ``job["drain_s"][rank]``."""
    from kvsnap.engines.vllm import KVSnapConnectorMetadata
    from tests.support.slow_fsync import slow_down_fsync

    slow_down_fsync(job["fsync_delay_s"], job["path"])
    options = {"shutdown_drain_s": job["drain_s"][rank], "event_log": job["event_log"]}
    worker = worker_for(job["path"], worker_cells(), rank, world, dist.group.WORLD, options)
    paths = []
    for index in range(job["requests"]):
        saves = worker_saves(worker, list(range(4 * index, 4 * index + 4)), f"r{index}")
        worker.wait_for_save(KVSnapConnectorMetadata(saves=saves))
        paths += [save.path for save in saves]
    worker.shutdown()
    return {"paths": paths}
