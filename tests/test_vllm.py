"""KVSnapConnector against real vLLM (CPU build): persist, restart, corruption, TP 2 <-> 1, dumps.

Every engine runs in a subprocess with ``.venv-vllm/bin/python`` (``scripts/setup_vllm_venv.sh``
creates it); this file skips as a whole without it. The engines share one random-weight Llama
with 2 KV heads and one scenario, so that only four engines start:

* E0, TP=1, no connector: the reference tokens of every prompt (runs beside E1).
* E1, TP=1, ``persist+dump``: computes A, B and C; persists A and B (C opts out) and dumps all.
* E2, TP=2, ``persist+dump``: loads A (a TP=1 capture) into TP=2, computes and persists C (a
  TP=2 capture, gathered on rank 0), dumps both.
* E3, TP=1, after B's snapshot is corrupted and two forged store entries are added: loads A,
  C (the TP=2 capture) and a 2-block prefix of A for D; B's load fails its checksum and is
  recomputed; F and G are logged misses; dumps all.

Every engine's tokens must equal E0's, and the dumps prove the restored cache bit-exact.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvsnap import format as fmt
from kvsnap.engines.vllm import (
    BlockOrder,
    PrefixStore,
    count_events,
    external_request_id,
    probe_block_order,
    read_events,
    vllm_layout,
)
from kvsnap.layout import LayoutError, check_tiling
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
HELPERS = Path(__file__).resolve().parent / "vllm"
BLOCK = 32
ENGINE_TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(
    not (VENV / ".installed").exists(),
    reason=f"real vLLM is not installed: run scripts/setup_vllm_venv.sh to create {VENV}",
)


# --------------------------------------------------------------------------------------------
# The layout of vLLM's registered caches (no engine needed)


def _random_cache(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(torch.bfloat16)


def _capture_one_sequence(layouts: list, tmp_path: Path, blocks: list[int]) -> Snapshot:
    tokens = np.arange(len(blocks) * layouts[0].geometry.block_size)
    source = fmt.SourceInfo("vllm", "test", "synthetic", None, "0" * 32)
    path = tmp_path / "snap.safetensors"
    capture(layouts, [SequenceBlocks("s", tokens, np.asarray(blocks))], path, source=source)
    return Snapshot.open(path)


def _vnni_offsets(tokens: int, heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """An AMX-style block order (what vLLM's CPU kernel does on AMX machines, per its writes):
    per head, keys as [D/2][N][2] (dim pairs interleaved), then values as
    [D/16][N/2][16][2] (token pairs interleaved)."""
    t, h, d = np.indices((tokens, heads, head_dim))
    plane = h * 2 * tokens * head_dim
    key = plane + (d // 2) * 2 * tokens + t * 2 + d % 2
    value = (
        plane + tokens * head_dim + (d // 16) * tokens * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
    )
    return key, value


def _vnni_writer(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
    tokens, heads, head_dim = key.shape
    key_offsets, value_offsets = _vnni_offsets(tokens, heads, head_dim)
    flat = block.view(-1)
    flat[torch.from_numpy(key_offsets.ravel())] = key.reshape(-1)
    flat[torch.from_numpy(value_offsets.ravel())] = value.reshape(-1)


def test_cpu_backend_block_order_is_learned_from_the_kernel(tmp_path: Path) -> None:
    blocks, heads, tokens, head_dim = 5, 2, BLOCK, 32
    order = probe_block_order(
        _vnni_writer, heads=heads, block_size=tokens, head_size=head_dim, dtype=torch.bfloat16
    )
    assert np.array_equal(order.key, _vnni_offsets(tokens, heads, head_dim)[0])
    keys = [_random_cache((blocks, tokens, heads, head_dim), seed) for seed in (1, 2)]
    values = [_random_cache((blocks, tokens, heads, head_dim), seed) for seed in (3, 4)]
    caches = [
        torch.zeros((blocks, heads, tokens, 2 * head_dim), dtype=torch.bfloat16) for _ in keys
    ]
    for cache, key, value in zip(caches, keys, values, strict=True):
        for block in range(blocks):
            _vnni_writer(key[block], value[block], cache[block : block + 1])
    layout = vllm_layout(
        caches,
        backend="CPU_ATTN",
        kv_cache_layout="LBHNC",
        head_size=head_dim,
        num_kv_heads=heads,
        block_order=order,
    )
    with _capture_one_sequence([layout], tmp_path, [4, 1]) as snap:
        for layer in range(2):
            for part, logical in (("key", keys[layer]), ("value", values[layer])):
                expected = logical[[4, 1]].reshape(2 * tokens, heads, head_dim)
                got = snap.sequence_kv("s", f"layers.{layer}.{part}")
                assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    with pytest.raises(LayoutError, match="block_order"):
        vllm_layout(
            caches, backend="CPU_ATTN", kv_cache_layout="LBHNC", head_size=32, num_kv_heads=2
        )


def test_block_order_probe_refuses_a_kernel_it_cannot_map() -> None:
    def drops_values(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
        _vnni_writer(key, torch.zeros_like(value), block)

    with pytest.raises(LayoutError, match="unwritten"):
        probe_block_order(
            drops_values, heads=2, block_size=BLOCK, head_size=32, dtype=torch.bfloat16
        )


@pytest.mark.parametrize("physical", ["LBNHC", "LBHNC"])
def test_cell_backends_follow_the_reported_physical_layout(tmp_path: Path, physical: str) -> None:
    # FLASH_ATTN: each (token, head) cell is key ‖ value; NHD or HND physically.
    blocks, heads, tokens, head_dim = 5, 4, BLOCK, 16
    order = (0, 2, 1, 3) if physical == "LBNHC" else (0, 1, 2, 3)
    physical_shape = [(blocks, heads, tokens, 2 * head_dim)[axis] for axis in order]
    storage = _random_cache(tuple(physical_shape), 3)
    inverse = tuple(order.index(axis) for axis in range(4))
    cache = storage.permute(*inverse)  # logical [B, H, N, C] over the physical tensor
    assert cache.shape == (blocks, heads, tokens, 2 * head_dim)
    layout = vllm_layout(
        [cache], backend="FLASH_ATTN", kv_cache_layout=physical, head_size=head_dim, num_kv_heads=4
    )
    with _capture_one_sequence([layout], tmp_path, [3, 0, 2]) as snap:
        cells = cache[[3, 0, 2]].transpose(1, 2).reshape(3 * tokens, heads, 2 * head_dim)
        for part, dims in (("key", slice(0, head_dim)), ("value", slice(head_dim, None))):
            got = snap.sequence_kv("s", f"layers.0.{part}")
            assert torch.equal(
                got.view(torch.int16), cells[..., dims].contiguous().view(torch.int16)
            )


def test_tp_ranks_tile_the_canonical_page(tmp_path: Path) -> None:
    # TP=2 over 2 KV heads: each rank holds one head; together they give the TP=1 snapshot.
    blocks, tokens, head_dim = 4, BLOCK, 32
    full = _random_cache((blocks, 2, tokens, 2 * head_dim), 5)
    ranks = [full[:, rank : rank + 1].contiguous() for rank in range(2)]

    def order(heads: int) -> BlockOrder:
        return BlockOrder(*_vnni_offsets(tokens, heads, head_dim))

    layouts = [
        vllm_layout(
            [cache],
            backend="CPU_ATTN",
            kv_cache_layout="LBHNC",
            head_size=head_dim,
            num_kv_heads=2,
            tp_rank=rank,
            tp_size=2,
            block_order=order(1),
        )
        for rank, cache in enumerate(ranks)
    ]
    check_tiling(layouts)
    reference = vllm_layout(
        [full],
        backend="CPU_ATTN",
        kv_cache_layout="LBHNC",
        head_size=head_dim,
        num_kv_heads=2,
        block_order=order(2),
    )
    with _capture_one_sequence(layouts, tmp_path, [2, 3]) as tp2:
        tp2_key = tp2.sequence_kv("s", "layers.0.value").clone()
    (tmp_path / "snap.safetensors").unlink()
    with _capture_one_sequence([reference], tmp_path, [2, 3]) as tp1:
        assert torch.equal(
            tp2_key.view(torch.int16), tp1.sequence_kv("s", "layers.0.value").view(torch.int16)
        )
    with pytest.raises(LayoutError, match="1 KV heads per rank"):
        vllm_layout(
            ranks,
            backend="CPU_ATTN",
            kv_cache_layout="LBHNC",
            head_size=32,
            num_kv_heads=4,
            tp_size=2,
            block_order=order(1),
        )


def test_unknown_or_contradicted_layouts_are_refused() -> None:
    cache = _random_cache((3, 2, BLOCK, 64), 7)
    with pytest.raises(LayoutError, match="FLASHINFER"):
        vllm_layout(
            [cache], backend="FLASHINFER", kv_cache_layout="LBHNC", head_size=32, num_kv_heads=2
        )
    with pytest.raises(LayoutError, match="unknown vLLM KV cache layout"):
        vllm_layout(
            [cache], backend="CPU_ATTN", kv_cache_layout="XYZ", head_size=32, num_kv_heads=2
        )
    # The tensor is head-major (HND) but vLLM would claim token-major (LBNHC): refused.
    with pytest.raises(LayoutError, match="reported the LBNHC layout"):
        vllm_layout(
            [cache], backend="FLASH_ATTN", kv_cache_layout="LBNHC", head_size=32, num_kv_heads=2
        )
    with pytest.raises(LayoutError, match="head size 16"):
        vllm_layout(
            [cache], backend="CPU_ATTN", kv_cache_layout="LBHNC", head_size=16, num_kv_heads=2
        )


def test_prefix_store_finds_the_longest_indexed_prefix(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, "ns")
    tokens = np.arange(10 * BLOCK)
    chain = fmt.prefix_hash_chain(tokens, BLOCK)
    assert store.longest_prefix(chain) is None
    first = store.snapshot_path(chain[3])
    store.publish_index(chain[:4], first)
    match = store.longest_prefix(chain)
    assert match is not None and (match.num_blocks, Path(match.path)) == (4, first)
    other = fmt.prefix_hash_chain(
        np.concatenate([tokens[: 2 * BLOCK], tokens[: 8 * BLOCK] + 1]), BLOCK
    )
    shared = store.longest_prefix(other)
    assert shared is not None and shared.num_blocks == 2
    assert external_request_id("req-7-0123abcd") == "req-7"
    assert external_request_id("req-7") == "req-7"


# --------------------------------------------------------------------------------------------
# The scenario against real vLLM


def _prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(2026)

    def tokens(count: int) -> list[int]:
        return rng.integers(1, 500, size=count).tolist()

    a = tokens(100)
    return {
        "A": a,  # 3 full blocks loadable
        "B": tokens(80),  # 2
        "C": tokens(129),  # 4 (its prompt ends exactly one token past a block)
        "D": a[: 2 * BLOCK] + tokens(40),  # shares A's first 2 blocks
        "F": tokens(90),
        "G": tokens(70),
    }


@dataclass
class EngineRun:
    """One finished engine: request label -> generated tokens, plus its event log and dumps."""

    tokens: dict[str, list[int]]
    cached: dict[str, int]
    events: list[dict[str, Any]]
    dumps: Path
    labels: dict[str, str]  # vLLM's external request id -> prompt label
    startup_seconds: float

    def events_for(self, name: str, label: str) -> list[dict[str, Any]]:
        return [
            event
            for event in self.events
            if event["event"] == name
            and self.labels.get(external_request_id(event["request"])) == label
        ]


@dataclass
class Scenario:
    model: Path
    prompts: dict[str, list[int]]
    reference: EngineRun
    e1: EngineRun
    e2: EngineRun
    e3: EngineRun
    store: Path
    namespace: Path
    snapshots: dict[str, Path]  # prompt label -> persisted snapshot
    corrupted: tuple[str, int]  # tensor, block flipped in B's snapshot
    corrupt_copy: Path  # B's snapshot as it was corrupted


def _job(
    tmp: Path,
    name: str,
    model: Path,
    labels: list[str],
    prompts: dict[str, list[int]],
    **options: Any,
) -> tuple[Path, dict[str, Any]]:
    connector = options.pop("connector", None)
    job = {
        "model": str(model),
        "tensor_parallel_size": options.pop("tp", 1),
        "connector": connector,
        "prompts": [
            {"token_ids": prompts[label], "persist": label not in options.get("no_persist", ())}
            for label in labels
        ],
        "max_tokens": 8,
        "output": str(tmp / f"{name}.out.json"),
    }
    path = tmp / f"{name}.job.json"
    path.write_text(json.dumps(job))
    return path, job


def _start(job_path: Path, log: Path) -> subprocess.Popen[bytes]:
    # The engine imports kvsnap from this tree (whatever the venv's editable install points at).
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [str(PYTHON), str(HELPERS / "run_engine.py"), str(job_path)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=str(job_path.parent),
    )


def _finish(
    process: subprocess.Popen[bytes],
    job: dict[str, Any],
    labels: list[str],
    log: Path,
    events: Path,
    dumps: Path,
) -> EngineRun:
    try:
        code = process.wait(timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    if code != 0 or not Path(job["output"]).exists():
        tail = log.read_text(errors="replace")[-6000:]
        raise AssertionError(f"vLLM engine failed (exit {code}); log tail:\n{tail}")
    result = json.loads(Path(job["output"]).read_text())
    by_label = {str(index): label for index, label in enumerate(labels)}
    tokens = {by_label[out["request_id"]]: out["token_ids"] for out in result["outputs"]}
    cached = {by_label[out["request_id"]]: out["num_cached_tokens"] for out in result["outputs"]}
    return EngineRun(
        tokens, cached, read_events(events), dumps, by_label, result["startup_seconds"]
    )


def _run(
    tmp: Path,
    name: str,
    model: Path,
    labels: list[str],
    prompts: dict[str, list[int]],
    **options: Any,
) -> EngineRun:
    process, job, log, events, dumps = _launch(tmp, name, model, labels, prompts, **options)
    return _finish(process, job, labels, log, events, dumps)


def _launch(
    tmp: Path,
    name: str,
    model: Path,
    labels: list[str],
    prompts: dict[str, list[int]],
    **options: Any,
) -> tuple[subprocess.Popen[bytes], dict[str, Any], Path, Path, Path]:
    events, dumps = tmp / f"{name}.events.jsonl", tmp / f"{name}.dumps"
    if options.get("connector") is not None:
        options["connector"] = {
            **options["connector"],
            "event_log": str(events),
            "dump_path": str(dumps),
        }
    job_path, job = _job(tmp, name, model, labels, prompts, **options)
    log = tmp / f"{name}.log"
    return _start(job_path, log), job, log, events, dumps


def _flip_byte(path: Path, tensor: str, block: int) -> None:
    """Flip one byte in the middle of ``block`` of ``tensor`` (found through the file header)."""
    data = bytearray(path.read_bytes())
    (header_size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_size])
    begin, end = header[tensor]["data_offsets"]
    num_blocks = header[tensor]["shape"][0]
    page = (end - begin) // num_blocks
    data[8 + header_size + begin + block * page + page // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def _forge_entries(
    scenario_store: Path, namespace: str, prompts: dict[str, list[int]], a_snapshot: Path
) -> None:
    """F: index entries that point at A's snapshot. G: a snapshot from another model fingerprint."""
    store = PrefixStore(scenario_store, namespace)
    chain_f = fmt.prefix_hash_chain(np.asarray(prompts["F"][: 2 * BLOCK]), BLOCK)
    store.publish_index(chain_f, a_snapshot)
    g_tokens = np.asarray(prompts["G"][: 2 * BLOCK])
    chain_g = fmt.prefix_hash_chain(g_tokens, BLOCK)
    cache = _random_cache((4, 2, BLOCK, 64), 11)
    layout = vllm_layout(
        [cache, cache.clone()],
        backend="CPU_ATTN",
        kv_cache_layout="LBHNC",
        head_size=32,
        num_kv_heads=2,
        block_order=BlockOrder(*_vnni_offsets(BLOCK, 2, 32)),
    )
    path = store.snapshot_path(chain_g[-1])
    source = fmt.SourceInfo("vllm", "0.32.0", "another-model", None, "f" * 32)
    capture(layout, [SequenceBlocks("G", g_tokens, np.array([0, 1]))], path, source=source)
    store.publish_index(chain_g, path)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    tmp = tmp_path_factory.mktemp("vllm")
    model = tmp / "model"
    subprocess.run(
        [str(PYTHON), str(HELPERS / "make_model.py"), str(model)], check=True, capture_output=True
    )
    prompts = _prompts()
    store = tmp / "store"
    persist = {"path": str(store), "mode": "persist+dump"}
    everything = ["A", "B", "C", "D", "F", "G"]
    # E0 (no connector) runs beside E1: start-up is mostly single-threaded Python.
    reference = _launch(tmp, "e0", model, everything, prompts)
    e1 = _run(tmp, "e1", model, ["A", "B", "C"], prompts, connector=persist, no_persist=("C",))
    process, job, log, events, dumps = reference
    reference_run = _finish(process, job, everything, log, events, dumps)
    namespaces = [path for path in store.iterdir() if path.is_dir()]
    assert len(namespaces) == 1, namespaces
    snapshots = {
        e1.labels[external_request_id(e["request"])]: Path(e["path"])
        for e in e1.events
        if e["event"] == "save"
    }
    e2 = _run(tmp, "e2", model, ["A", "C"], prompts, connector=persist, tp=2)
    snapshots.update(
        {
            e2.labels[external_request_id(e["request"])]: Path(e["path"])
            for e in e2.events
            if e["event"] == "save"
        }
    )
    corrupted = ("layers.1.value", 1)
    _flip_byte(snapshots["B"], *corrupted)
    # E3 replaces the corrupt snapshot once it has recomputed B; keep the damaged bytes.
    corrupt_copy = tmp / "corrupt-B.safetensors"
    corrupt_copy.write_bytes(snapshots["B"].read_bytes())
    _forge_entries(store, namespaces[0].name, prompts, snapshots["A"])
    e3 = _run(tmp, "e3", model, everything, prompts, connector=persist)
    return Scenario(
        model,
        prompts,
        reference_run,
        e1,
        e2,
        e3,
        store,
        namespaces[0],
        snapshots,
        corrupted,
        corrupt_copy,
    )


def _sequence_kv(path: Path, num_tokens: int) -> dict[str, torch.Tensor]:
    """Each layer part of the snapshot's only sequence: its first ``num_tokens`` tokens' bits."""
    with Snapshot.open(path) as snap:
        (record,) = snap.sequences
        return {
            name: snap.sequence_kv(record.id, name)[:num_tokens].clone().view(torch.int16)
            for name in snap.geometry.tensor_names()
        }


def _assert_same_kv(first: Path, second: Path, num_tokens: int) -> None:
    a, b = _sequence_kv(first, num_tokens), _sequence_kv(second, num_tokens)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape[0] == num_tokens, (name, a[name].shape)
        assert torch.equal(a[name], b[name]), f"{name} differs between {first} and {second}"


def _dump(run: EngineRun, label: str) -> Path:
    request = next(rid for rid, name in run.labels.items() if name == label)
    return run.dumps / f"{request}.safetensors"


def test_persisted_prompts_load_after_restart_with_the_same_tokens(scenario: Scenario) -> None:
    reference, e1, e3 = scenario.reference, scenario.e1, scenario.e3
    for label in ("A", "B", "C"):
        assert e1.tokens[label] == reference.tokens[label], label
    # E1 computed everything, persisted the full blocks of A and B, not of C (opted out).
    assert [e["tokens"] for e in e1.events_for("save", "A")] == [96]
    assert [e["tokens"] for e in e1.events_for("save", "B")] == [64]
    assert e1.events_for("save", "C") == [] and count_events(e1.events, "hit") == 0
    # E3 started fresh and skipped the stored prefixes: A whole, D the 2 blocks it shares with A.
    for label, skipped in (("A", 96), ("D", 64)):
        assert [e["tokens"] for e in e3.events_for("hit", label)] == [skipped], label
        assert [e["tokens"] for e in e3.events_for("load", label)] == [skipped], label
        assert e3.cached[label] == skipped, label
        assert e3.tokens[label] == reference.tokens[label], label
    assert e3.events_for("load", "D")[0]["path"] == str(scenario.snapshots["A"])
    # The restored blocks are the persisted bytes: E3's dumps start with them.
    _assert_same_kv(_dump(e3, "A"), scenario.snapshots["A"], 96)
    _assert_same_kv(_dump(e3, "D"), scenario.snapshots["A"], 64)
    # A prefix already in the store is not written again.
    assert e3.events_for("save", "A") == [] and e3.events_for("save", "D") != []


def test_corrupt_snapshot_is_detected_reported_and_recomputed(scenario: Scenario) -> None:
    e3, tensor_name = scenario.e3, scenario.corrupted[0]
    # The header is intact, so the scheduler matched; the worker's checksum check refused it.
    assert [e["tokens"] for e in e3.events_for("hit", "B")] == [64]
    assert e3.events_for("load", "B") == []
    (failure,) = e3.events_for("load_failed", "B")
    assert "SnapshotCorruptError" in failure["error"] and tensor_name in failure["error"], failure
    assert failure["path"] == str(scenario.snapshots["B"])
    assert e3.tokens["B"] == scenario.reference.tokens["B"]
    # The recomputed KV is the KV E1 computed (same engine, same kernel): not the corrupt bytes.
    _assert_same_kv(_dump(e3, "B"), _dump(scenario.e1, "B"), 80)
    # Once recomputed, B is persisted again over the snapshot that failed.
    (save,) = e3.events_for("save", "B")
    assert save["path"] == str(scenario.snapshots["B"]) and save["tokens"] == 64
    with Snapshot.open(scenario.snapshots["B"]) as snap:
        assert snap.verify() == []
    _assert_same_kv(scenario.snapshots["B"], _dump(e3, "B"), 64)


def test_mismatching_store_entries_are_logged_misses(scenario: Scenario) -> None:
    e3, reference = scenario.e3, scenario.reference
    (forged_index,) = e3.events_for("miss", "F")
    assert "no sequence in the snapshot holds the indexed prefix" in forged_index["reason"]
    (other_model,) = e3.events_for("miss", "G")
    assert "model fingerprint ffffffffffffffff differs" in other_model["reason"]
    for label in ("F", "G"):
        assert e3.events_for("load", label) == [] and e3.cached[label] == 0
        assert e3.tokens[label] == reference.tokens[label], label


def test_tp2_capture_restores_at_tp1_and_tp1_capture_at_tp2(scenario: Scenario) -> None:
    e1, e2, e3, reference = scenario.e1, scenario.e2, scenario.e3, scenario.reference
    # TP=1 capture (E1) into TP=2 (E2): both ranks load their own heads of the same blocks.
    loads = e2.events_for("load", "A")
    assert sorted(e["rank"] for e in loads) == [0, 1] and {e["tokens"] for e in loads} == {96}
    assert e2.tokens["A"] == reference.tokens["A"] and e2.cached["A"] == 96
    _assert_same_kv(_dump(e2, "A"), scenario.snapshots["A"], 96)
    # TP=2 capture (E2, gathered on rank 0 and written once) into TP=1 (E3).
    (save,) = e2.events_for("save", "C")
    assert save["rank"] == 0 and save["tokens"] == 128
    with Snapshot.open(scenario.snapshots["C"]) as snap:
        assert snap.metadata.tp_size == 2 and snap.geometry.num_kv_heads == 2
        assert snap.verify() == []
    _assert_same_kv(_dump(e2, "C"), scenario.snapshots["C"], 128)
    assert [e["tokens"] for e in e3.events_for("load", "C")] == [128]
    assert e3.tokens["C"] == reference.tokens["C"] and e2.tokens["C"] == reference.tokens["C"]
    _assert_same_kv(_dump(e3, "C"), scenario.snapshots["C"], 128)
    # The assembled TP=2 snapshot holds the TP=1 KV (E1's dump of C) up to the bf16 rounding
    # of TP's all-reduce in layer 1: two bf16 steps at the values' scale (|KV| < 16, one step
    # 0.0625 there). Heads in the wrong place would differ by the values' own size (~10).
    with Snapshot.open(scenario.snapshots["C"]) as tp2, Snapshot.open(_dump(e1, "C")) as tp1:
        comparison = tp2.compare(tp1, atol=0.125)
        assert comparison.ok, comparison.report()
        for name in tp2.geometry.tensor_names():
            assert tp2.sequence_kv(tp2.sequences[0].id, name).float().abs().max() < 16, name


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    result = subprocess.run(
        [str(VENV / "bin" / "kvsnap"), *args, "--json"], capture_output=True, text=True, timeout=120
    )
    return result.returncode, json.loads(result.stdout)


def test_dump_is_read_back_by_the_kvsnap_cli(scenario: Scenario) -> None:
    dump = _dump(scenario.e1, "A")
    code, info = _cli("inspect", str(dump))
    assert code == 0
    assert (
        info["model"]["engine"] == "vllm"
        and info["layout"]["capture_encoding"] == "vllm-cpu-attn-lbhnc"
    )
    assert info["layout"]["num_kv_heads"] == 2 and info["layout"]["block_size"] == BLOCK
    assert [(s["num_tokens"], s["num_blocks"]) for s in info["sequences"]] == [(100, 4)]
    code, report = _cli("verify", str(dump))
    assert (code, report) == (0, {"ok": True, "problems": []})
    # The same CLI names the corrupted persisted block.
    code, report = _cli("verify", str(scenario.corrupt_copy))
    assert code != 0 and not report["ok"]
    tensor, block = scenario.corrupted
    assert any(p["tensor"] == tensor and p["block"] == block for p in report["problems"]), report


def _transformers_capture(model_dir: Path, tokens: list[int], path: Path, perturb: bool) -> None:
    """Prefill ``tokens`` with transformers (bf16, eager) and capture the DynamicCache."""
    from kvsnap.engines import transformers as hf
    from kvsnap.engines.default_model import load_model

    loaded = load_model(str(model_dir), dtype=torch.bfloat16)
    if perturb:
        with torch.no_grad():  # layer 1's keys change; its values and all of layer 0 do not
            loaded.model.model.layers[1].self_attn.k_proj.weight.mul_(1.25)
    cache = hf.new_dynamic_cache(loaded)
    hf.forward_with_cache(loaded, tokens, cache)
    hf.capture_dynamic_cache(
        cache, [tokens], path, model=loaded, block_size=BLOCK, sequence_ids=["0"]
    )


def test_vllm_dump_agrees_with_transformers_and_names_a_perturbed_layer(
    scenario: Scenario, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    dump = _dump(scenario.e1, "A")
    reference, perturbed = tmp_path / "hf.safetensors", tmp_path / "hf-perturbed.safetensors"
    _transformers_capture(scenario.model, scenario.prompts["A"], reference, perturb=False)
    _transformers_capture(scenario.model, scenario.prompts["A"], perturbed, perturb=True)
    with Snapshot.open(dump) as vllm_snap, Snapshot.open(reference) as hf_snap:
        # Same model, seen by two engines: one fingerprint.
        assert (
            vllm_snap.metadata.source.model_fingerprint == hf_snap.metadata.source.model_fingerprint
        )
    # Two bf16 engines with different kernels agree within a few bf16 steps (|KV| < 16).
    tolerance = ["--atol", "0.25"]
    code, report = _cli("verify", str(dump), "--against", str(reference), *tolerance)
    assert (code, report) == (0, {"ok": True, "problems": []}), report
    code, report = _cli("verify", str(dump), "--against", str(perturbed), *tolerance)
    assert code != 0 and not report["ok"]
    assert {problem["tensor"] for problem in report["problems"]} == {"layers.1.key"}, report
    (problem,) = report["problems"]
    assert problem["first_mismatch"]["sequence"] == "0" and problem["max_abs_diff"] > 1
