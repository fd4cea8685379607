"""KVSnapConnector against real vLLM (CPU build): persist, restart, sharing, corruption, eviction.

Every engine runs in a subprocess with ``.venv-vllm/bin/python`` (``scripts/setup_vllm_venv.sh``
creates it); this file skips as a whole without it. The engines share one random-weight Llama
with 2 KV heads, one store (chunks of 2 blocks of 32 tokens) and one scenario:

* E0, TP=1, no connector: the reference tokens of every prompt (runs beside E1).
* E1, TP=1: computes A, B, C and S1..S4 (one 4-block system prompt, each its own 70-token
  question); persists A, B and the S prompts (C opts out), dumps all.
* E2, TP=2: loads A (a TP=1 capture) into TP=2, computes and persists C (a TP=2 capture,
  gathered on rank 0), dumps both.
* E3, TP=1, ``verify_before_load`` off, after B's chunk is corrupted and two forged chunks are
  added: loads A, C, the S prompts and A's first chunk for D; B's load fails its checksum in
  the worker and is recomputed; F and G are logged misses; the bad chunks are quarantined.
* E4, TP=1, vLLM's default ``kv_load_failure_policy``, after one byte of KV data is flipped in
  every chunk: every chunk fails the scheduler's check, is quarantined and recomputed.
* E5, TP=1, default policy, a capacity bound: loads the fresh chunks E4 wrote, stores H and
  evicts the quarantined chunks and the least recently used ones to fit the bound.

Every engine's tokens must equal E0's, and the dumps prove the restored cache bit-exact.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvsnap import format as fmt
from kvsnap.engines.vllm import (
    CacheIdentity,
    PrefixStore,
    StoreEntry,
    chunk_sequence_id,
    count_events,
    store_bytes,
    store_entries,
    store_key_chain,
    vllm_layout,
)
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture
from tests.support.vllm_engines import (
    HELPERS,
    PYTHON,
    ROOT,
    EngineRun,
    finish_engine,
    launch_engine,
    run_engine,
)

BLOCK = 32
CHUNK_BLOCKS = 2
SHARING = ("S1", "S2", "S3", "S4")

pytestmark = pytest.mark.vllm


def _prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(2026)

    def tokens(count: int) -> list[int]:
        return rng.integers(1, 500, size=count).tolist()

    a = tokens(100)
    system = tokens(4 * BLOCK)
    return {
        "A": a,  # 3 full blocks loadable: chunks [0, 2) and [2, 3)
        "B": tokens(80),  # 2: chunk [0, 2)
        "C": tokens(129),  # 4 (its prompt ends exactly one token past a block)
        "D": a[: 2 * BLOCK] + tokens(40),  # shares A's first chunk
        "F": tokens(90),
        "G": tokens(70),
        # 198 tokens, 6 loadable blocks: chunks [0, 2) and [2, 4) shared, [4, 6) their own.
        **{label: system + tokens(70) for label in SHARING},
        "H": tokens(100),
    }


@dataclass
class Scenario:
    model: Path
    prompts: dict[str, list[int]]
    runs: dict[str, EngineRun]
    store: Path
    namespace: Path
    chunks: dict[str, list[Path]]  # prompt label -> its persisted chunks (E1, E2)
    kept: dict[str, list[Path]]  # copies of those chunks as E1 and E2 wrote them
    corrupted: tuple[str, int]  # tensor, block flipped in B's chunk
    corrupt_copy: Path  # B's chunk as it was corrupted
    bytes_after_e1: dict[Path, int]  # every chunk on disk after E1 -> its size
    flipped: list[Path] = field(default_factory=list)  # chunks damaged before E4
    quarantine_problems: dict[str, int] = field(default_factory=dict)  # after E4
    capacity: int = 0  # E5's store_capacity_bytes
    bytes_after_e5: int = 0


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


def _chunk_entries(store: Path) -> list[StoreEntry]:
    """The store's chunks (single files, and parted chunks written at TP > 1)."""
    return [e for e in store_entries(store) if not e.quarantined and not e.orphan]


def _chunk_files(store: Path) -> list[Path]:
    """Each chunk's path as the connector names it (``HASH.safetensors``, in either form)."""
    return [Path(str(entry.path).removesuffix(".index.json")) for entry in _chunk_entries(store)]


def _keep(path: Path, copy: Path) -> Path:
    """A copy of the chunk at ``path`` as it is now; a parted chunk's index and parts go to a
    directory of their own, under their own names (the index names them)."""
    copy.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        copy.write_bytes(path.read_bytes())
        return copy
    index = Path(f"{path}.index.json")
    names = json.loads(index.read_text())["metadata"]["kvsnap.parts"]
    directory = copy.with_suffix("")
    directory.mkdir()
    for name in [index.name, *(part["file"] for part in names)]:
        (directory / name).write_bytes((path.parent / name).read_bytes())
    return directory / path.name


def _forge_chunks(
    store_dir: Path, namespace: str, prompts: dict[str, list[int]], a_chunk: Path
) -> None:
    """F: A's first chunk stored under F's name. G: a chunk from another model fingerprint."""
    store = PrefixStore(store_dir, namespace, chunk_blocks=CHUNK_BLOCKS)
    chain_f = _keys(prompts["F"][: 2 * BLOCK])
    store.chunk_path(chain_f[1]).parent.mkdir(parents=True, exist_ok=True)
    store.chunk_path(chain_f[1]).write_bytes(a_chunk.read_bytes())
    g_tokens = np.asarray(prompts["G"][: 2 * BLOCK])
    chain_g = _keys(g_tokens)
    generator = torch.Generator().manual_seed(11)
    caches = [
        torch.randn((2, 2, BLOCK, 64), generator=generator).to(torch.bfloat16) for _ in range(2)
    ]
    layout = vllm_layout(
        caches, backend="FLASH_ATTN", kv_cache_layout="LBHNC", head_size=32, num_kv_heads=2
    )
    source = fmt.SourceInfo("vllm", "0.32.0", "another-model", None, "f" * 32)
    sequence = SequenceBlocks(chunk_sequence_id(0, None, chain_g[1]), g_tokens, np.array([0, 1]))
    path = store.chunk_path(chain_g[1])
    path.parent.mkdir(parents=True, exist_ok=True)
    capture(layout, [sequence], path, source=source)


def _keys(tokens: Sequence[int]) -> list[str]:
    """The store keys of a plain text prompt's blocks (no LoRA, salt or images)."""
    return store_key_chain(np.asarray(tokens), BLOCK, CacheIdentity())


def _problems(path: Path) -> int:
    """How many problems ``verify`` finds in the snapshot at ``path`` (1: it does not open)."""
    try:
        with Snapshot.open(path) as snap:
            return len(snap.verify())
    except Exception:
        return 1


def _first_runs(tmp: Path, model: Path, prompts: dict[str, list[int]], persist: dict) -> Scenario:
    """E0 beside E1, then E2 (TP=2): the store the later engines restart from."""
    reference = launch_engine(tmp, "e0", model, list(prompts), prompts)
    first = ["A", "B", "C", *SHARING]
    e1 = run_engine(tmp, "e1", model, first, prompts, connector=persist, no_persist=("C",))
    process, job, log, events, dumps = reference
    runs = {"e0": finish_engine(process, job, list(prompts), log, events, dumps), "e1": e1}
    store = Path(persist["path"])
    namespaces = [path for path in store.iterdir() if path.is_dir()]
    assert len(namespaces) == 1, namespaces
    bytes_after_e1 = {entry.path: entry.size for entry in _chunk_entries(store)}
    runs["e2"] = run_engine(tmp, "e2", model, ["A", "C"], prompts, connector=persist, tp=2)
    chunks = {**e1.saved(), **runs["e2"].saved()}
    # Later engines quarantine and rewrite these files: keep them as they were written.
    kept: dict[str, list[Path]] = {}
    for label, paths in chunks.items():
        for index, path in enumerate(paths):
            copy = _keep(path, tmp / "kept" / f"{label}-{index}.safetensors")
            kept.setdefault(label, []).append(copy)
    corrupted = ("layers.1.value", 1)
    _flip_byte(chunks["B"][0], *corrupted)
    corrupt_copy = tmp / "corrupt-B.safetensors"
    corrupt_copy.write_bytes(chunks["B"][0].read_bytes())
    _forge_chunks(store, namespaces[0].name, prompts, chunks["A"][0])
    return Scenario(
        model,
        prompts,
        runs,
        store,
        namespaces[0],
        chunks,
        kept,
        corrupted,
        corrupt_copy,
        bytes_after_e1,
    )


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    tmp = tmp_path_factory.mktemp("vllm")
    model = tmp / "model"
    subprocess.run(
        [str(PYTHON), str(HELPERS / "vllm_make_model.py"), str(model)],
        check=True,
        capture_output=True,
    )
    prompts = _prompts()
    persist = {"path": str(tmp / "store"), "mode": "persist+dump", "chunk_blocks": CHUNK_BLOCKS}
    scene = _first_runs(tmp, model, prompts, persist)
    restart = ["A", "B", "C", "D", "F", "G", *SHARING]
    lenient = {**persist, "verify_before_load": False}
    scene.runs["e3"] = run_engine(tmp, "e3", model, restart, prompts, connector=lenient)
    # One byte of KV data flipped in every chunk file (every part of a parted chunk); vLLM's
    # default load failure policy.
    scene.flipped = _chunk_files(scene.store)
    for entry in _chunk_entries(scene.store):
        for path in entry.parts or (entry.path,):
            _flip_byte(path, "layers.0.key", 0)
    damaged = ["A", "B", "C", "D", "F", "G", *SHARING]
    scene.runs["e4"] = run_engine(
        tmp, "e4", model, damaged, prompts, connector=persist, policy=None
    )
    scene.quarantine_problems = {
        str(entry.path): _problems(entry.path)
        for entry in store_entries(scene.store)
        if entry.quarantined
    }
    scene.capacity = sum(entry.size for entry in _chunk_entries(scene.store))
    bounded = {**persist, "store_capacity_bytes": scene.capacity, "store_min_idle_s": 0}
    last = ["A", "S1", "S2", "H"]
    scene.runs["e5"] = run_engine(tmp, "e5", model, last, prompts, connector=bounded, policy=None)
    scene.bytes_after_e5 = store_bytes(scene.store)
    return scene


def _kv(paths: Path | list[Path], num_tokens: int) -> dict[str, torch.Tensor]:
    """Each layer part of the snapshots' one sequence each, concatenated in order: the KV of
    the first ``num_tokens`` tokens (a list of chunks gives their prefix)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for path in [paths] if isinstance(paths, Path) else paths:
        with Snapshot.open(path) as snap:
            (record,) = snap.sequences
            for name in snap.geometry.tensor_names():
                parts.setdefault(name, []).append(snap.sequence_kv(record.id, name).clone())
    return {name: torch.cat(values)[:num_tokens] for name, values in parts.items()}


def _assert_same_kv(first: Path | list[Path], second: Path | list[Path], num_tokens: int) -> None:
    a, b = _kv(first, num_tokens), _kv(second, num_tokens)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape[0] == num_tokens, (name, a[name].shape)
        assert torch.equal(a[name].view(torch.int16), b[name].view(torch.int16)), (
            f"{name} differs between {first} and {second}"
        )


def _dump(run: EngineRun, label: str) -> Path:
    request = next(rid for rid, name in run.labels.items() if name == label)
    return run.dumps / f"{request}.safetensors"


def _tokens(run: EngineRun, name: str, label: str) -> list[int]:
    return [event["tokens"] for event in run.events_for(name, label)]


def test_persisted_prompts_load_after_restart_with_the_same_tokens(scenario: Scenario) -> None:
    runs, chunks = scenario.runs, scenario.chunks
    reference, e1, e3 = runs["e0"], runs["e1"], runs["e3"]
    for label in ("A", "B", "C"):
        assert e1.tokens[label] == reference.tokens[label], label
    # E1 computed everything and persisted the loadable blocks of A and B as chunks of two
    # blocks (A's third block alone), none of C (opted out).
    assert _tokens(e1, "save", "A") == [64, 32] and _tokens(e1, "save", "B") == [64]
    # Nothing of A, B or C was stored before E1 (later requests of E1 may find chunks that
    # E1 itself stored a moment earlier, depending on the scheduler's timing).
    assert e1.events_for("save", "C") == []
    assert all(e1.events_for("hit", label) == [] for label in ("A", "B", "C"))
    # E3 started fresh and skipped the stored prefixes: A whole, D the chunk it shares with A.
    for label, skipped in (("A", 96), ("D", 64)):
        assert _tokens(e3, "hit", label) == [skipped], label
        assert _tokens(e3, "load", label) == [skipped], label
        assert e3.cached[label] == skipped, label
        assert e3.tokens[label] == reference.tokens[label], label
    assert e3.events_for("load", "D")[0]["paths"] == [str(chunks["A"][0])]
    # The restored blocks are the persisted bytes: E3's dumps start with them.
    _assert_same_kv(_dump(e3, "A"), scenario.kept["A"], 96)
    _assert_same_kv(_dump(e3, "D"), scenario.kept["A"][:1], 64)
    # A prefix already in the store is not written again; D stores only its own chunk.
    assert e3.events_for("save", "A") == [] and _tokens(e3, "save", "D") == [32]


def test_requests_sharing_a_prefix_store_it_once(scenario: Scenario) -> None:
    runs, prompts = scenario.runs, scenario.prompts
    e1, e3 = runs["e1"], runs["e3"]
    store = PrefixStore(scenario.store, scenario.namespace.name, chunk_blocks=CHUNK_BLOCKS)
    chain = _keys(prompts["S1"][: 6 * BLOCK])
    shared = [store.chunk_path(chain[1]), store.chunk_path(chain[3])]
    saved = {label: e1.saved().get(label, []) for label in SHARING}
    # Four requests behind one 4-block system prompt: its two chunks were written once, and
    # each request wrote its own last chunk only.
    written = [path for label in SHARING for path in saved[label]]
    assert sorted(written) == sorted(set(written)) and len(written) == 2 + len(SHARING)
    assert set(shared) <= set(written)
    own = {label: [path for path in saved[label] if path not in shared] for label in SHARING}
    assert all(len(paths) == 1 for paths in own.values()), own
    # Bytes on disk, measured after E1: the shared prefix once, not once per request.
    on_disk = scenario.bytes_after_e1
    shared_bytes = sum(on_disk[path] for path in shared)
    own_bytes = sum(on_disk[paths[0]] for paths in own.values())
    sharing_bytes = sum(on_disk[path] for path in written)
    assert sharing_bytes == shared_bytes + own_bytes
    assert sharing_bytes < len(SHARING) * shared_bytes  # per-request storage would need more
    a_and_b = sum(on_disk[path] for path in [*scenario.chunks["A"], *scenario.chunks["B"]])
    assert sum(on_disk.values()) == sharing_bytes + a_and_b
    # After a restart every one of them loads the shared chunks, then its own.
    for label in SHARING:
        (load,) = e3.events_for("load", label)
        assert load["paths"] == [str(path) for path in [*shared, *own[label]]], label
        assert load["tokens"] == 6 * BLOCK and e3.cached[label] == 6 * BLOCK
        assert e3.tokens[label] == runs["e0"].tokens[label] == e1.tokens[label], label


def test_corrupt_chunk_found_while_loading_is_reported_and_recomputed(
    scenario: Scenario,
) -> None:
    e1, e3, tensor_name = scenario.runs["e1"], scenario.runs["e3"], scenario.corrupted[0]
    chunk = str(scenario.chunks["B"][0])
    # E3 does not verify before loading: the header is intact, so the scheduler matched and
    # the worker's checksum check refused the chunk.
    assert _tokens(e3, "hit", "B") == [64] and e3.events_for("load", "B") == []
    (failure,) = e3.events_for("load_failed", "B")
    # The warm pipeline writes every page that passed and names the ones that did not.
    assert "RestoreIncompleteError" in failure["error"], failure
    assert "failed their checksum" in failure["error"] and tensor_name in failure["error"]
    assert failure["path"] == chunk
    (moved,) = e3.events_for("quarantine", "B")
    assert moved["role"] == "worker" and moved["path"] == chunk
    assert scenario.quarantine_problems[moved["moved_to"]] > 0  # still the damaged file
    assert e3.tokens["B"] == scenario.runs["e0"].tokens["B"]
    # The recomputed KV is the KV E1 computed (same engine, same kernel): not the corrupt bytes.
    _assert_same_kv(_dump(e3, "B"), _dump(e1, "B"), 80)
    # Once recomputed, B is persisted again, a fresh chunk in place of the quarantined one.
    (save,) = e3.events_for("save", "B")
    assert save["path"] == chunk and save["tokens"] == 64


def test_mismatching_chunks_are_logged_misses_and_quarantined(scenario: Scenario) -> None:
    e3, reference = scenario.runs["e3"], scenario.runs["e0"]
    (forged_copy,) = e3.events_for("miss", "F")
    assert "is not this prompt's prefix" in forged_copy["reason"]
    (other_model,) = e3.events_for("miss", "G")
    assert "model fingerprint ffffffffffffffff differs" in other_model["reason"]
    for label, miss in (("F", forged_copy), ("G", other_model)):
        (moved,) = e3.events_for("quarantine", label)
        assert moved["path"] == miss["path"] and moved["moved_to"] in scenario.quarantine_problems
        assert _tokens(e3, "save", label) == [64]  # computed, then stored as a fresh chunk
        assert e3.events_for("load", label) == [] and e3.cached[label] == 0
        assert e3.tokens[label] == reference.tokens[label], label


def test_tp2_capture_restores_at_tp1_and_tp1_capture_at_tp2(scenario: Scenario) -> None:
    runs, kept = scenario.runs, scenario.kept
    e1, e2, e3, reference = runs["e1"], runs["e2"], runs["e3"], runs["e0"]
    # TP=1 capture (E1) into TP=2 (E2): both ranks load their own heads of the same blocks.
    loads = e2.events_for("load", "A")
    assert sorted(e["rank"] for e in loads) == [0, 1] and {e["tokens"] for e in loads} == {96}
    assert e2.tokens["A"] == reference.tokens["A"] and e2.cached["A"] == 96
    _assert_same_kv(_dump(e2, "A"), kept["A"], 96)
    # TP=2 capture (E2, gathered on rank 0 and written once per chunk) into TP=1 (E3).
    saves = e2.events_for("save", "C")
    assert [(e["rank"], e["tokens"]) for e in saves] == [(0, 64), (0, 64)]
    for path in kept["C"]:
        with Snapshot.open(path) as snap:
            assert snap.metadata.tp_size == 2 and snap.geometry.num_kv_heads == 2
            assert snap.verify() == []
    _assert_same_kv(_dump(e2, "C"), kept["C"], 128)
    assert _tokens(e3, "load", "C") == [128]
    assert e3.tokens["C"] == reference.tokens["C"] and e2.tokens["C"] == reference.tokens["C"]
    _assert_same_kv(_dump(e3, "C"), kept["C"], 128)
    # The TP=2 chunks hold the TP=1 KV (E1's dump of C) up to the bf16 rounding of TP's
    # all-reduce in layer 1: two bf16 steps at the values' scale (|KV| < 16, one step 0.0625
    # there). Heads in the wrong place would differ by the values' own size (~10).
    tp2, tp1 = _kv(kept["C"], 128), _kv(_dump(e1, "C"), 128)
    for name, values in tp2.items():
        assert (values.float() - tp1[name].float()).abs().max() <= 0.125, name
        assert values.float().abs().max() < 16, name


def test_corrupted_store_under_default_policy_costs_a_recompute_never_a_request(
    scenario: Scenario,
) -> None:
    e4, reference = scenario.runs["e4"], scenario.runs["e0"]
    assert (
        json.loads((scenario.store.parent / "e4.job.json").read_text())["load_failure_policy"]
        is None
    )
    for label, tokens in e4.tokens.items():
        assert len(tokens) == 8 and tokens == reference.tokens[label], label
    # Nothing was served from a damaged chunk: no load failed, and the only loads (of prompts
    # scheduled after another had recomputed and stored their prefix again) read chunks this
    # engine wrote itself, after it had written them.
    assert count_events(e4.events, "load_failed") == 0
    written = {event["path"]: event["time"] for event in e4.events if event["event"] == "save"}
    for label in e4.tokens:
        loads = e4.events_for("load", label)
        assert e4.cached[label] == sum(load["tokens"] for load in loads), label
        for load in loads:
            assert all(written.get(path, load["time"]) < load["time"] for path in load["paths"])
    misses = [event for event in e4.events if event["event"] == "miss"]
    assert misses and all("failed verification" in event["reason"] for event in misses)
    # Every damaged chunk was quarantined (matched ones at the match, the others when their
    # prompt was persisted again), and each quarantined file still fails verification.
    moved = {
        event["path"]: event["moved_to"] for event in e4.events if event["event"] == "quarantine"
    }
    assert sorted(moved) == sorted(map(str, scenario.flipped))
    assert all(scenario.quarantine_problems[target] > 0 for target in moved.values())
    # Once recomputed, every prompt was persisted again: fresh chunks at the same names.
    resaved = {event["path"] for event in e4.events if event["event"] == "save"}
    assert resaved == set(moved)


def test_second_restart_loads_fresh_chunks_and_evicts_at_the_capacity_bound(
    scenario: Scenario,
) -> None:
    e5, reference = scenario.runs["e5"], scenario.runs["e0"]
    for name in ("miss", "quarantine", "load_failed"):
        assert count_events(e5.events, name) == 0, name
    for label, tokens in (("A", 96), ("S1", 192), ("S2", 192)):
        assert _tokens(e5, "load", label) == [tokens] and e5.cached[label] == tokens, label
    for label in e5.tokens:
        assert e5.tokens[label] == reference.tokens[label], label
    loaded = {path for event in e5.events if event["event"] == "load" for path in event["paths"]}
    for path in loaded:  # the chunks E4 wrote, never a quarantined file
        assert Path(path).exists() and _problems(Path(path)) == 0, path
        assert "quarantine" not in path
    # H's chunks pushed the store over its bound: the quarantined files went first, then the
    # least recently used chunks; none that E5 used.
    evicted = [event for event in e5.events if event["event"] == "evict"]
    quarantined = {event["path"] for event in evicted if event["quarantined"]}
    assert quarantined == set(scenario.quarantine_problems)
    chunks = {event["path"] for event in evicted if not event["quarantined"]}
    assert chunks and not chunks & loaded
    assert not chunks & {str(path) for path in e5.saved()["H"]}
    assert scenario.bytes_after_e5 <= scenario.capacity
    assert len(e5.saved()["H"]) == 2


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    # This tree's CLI and library, as the engines use them (not whatever the venv installed).
    result = subprocess.run(
        [str(PYTHON), "-m", "kvsnap.cli", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return result.returncode, json.loads(result.stdout)


def test_dumps_and_chunks_are_read_by_the_kvsnap_cli(scenario: Scenario) -> None:
    dump = _dump(scenario.runs["e1"], "A")
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
    # A stored chunk is an ordinary snapshot too: one sequence, named by where it starts.
    code, info = _cli("inspect", str(scenario.kept["A"][1]))
    a_keys = _keys(scenario.prompts["A"][: 3 * BLOCK])  # A's 3 loadable blocks
    assert code == 0
    assert [(s["id"], s["num_tokens"]) for s in info["sequences"]] == [
        (chunk_sequence_id(2, a_keys[1], a_keys[2]), 32)
    ]
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
    dump = _dump(scenario.runs["e1"], "A")
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
