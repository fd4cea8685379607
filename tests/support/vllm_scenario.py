"""The real-vLLM scenario the restart and dump tests share: engines E0-E5 on one store, run once
per session (``tests/engines/vllm/test_restarts.py`` describes them), and the checks on their
dumps and chunks; and the perturbed-model run ``test_dumps.py`` compares with them. Both are
worlds of ``vllm_worlds.py`` (``WORLD``, ``PERTURBED``)."""

from __future__ import annotations

import json
import struct
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
    store_bytes,
    store_entries,
    store_key_chain,
    vllm_layout,
)
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture
from tests.support.vllm_engines import EngineRun, run_engine
from tests.support.vllm_worlds import Job, World

BLOCK = 32
CHUNK_BLOCKS = 2
SHARING = ("S1", "S2", "S3", "S4")
#: Seconds every fsync into the store waits in E2: C's chunks (a part, its directory, then
#: rank 0's index and its directory: 4 fsyncs each) outlast the 5 s vLLM gives an engine shut
#: down without a timeout, so without one none of them would be stored (seen: 0 of 2);
#: tests/support/vllm_run_engine.py gives it the time.
E2_FSYNC_S = 1.0


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


@dataclass(frozen=True)
class _Inputs:
    """What the scenario's jobs share: its directory, the model, the prompts, the store."""

    tmp: Path
    model: Path
    prompts: dict[str, list[int]]
    persist: dict


def _prepare(tmp: Path, model: Path) -> _Inputs:
    persist = {"path": str(tmp / "store"), "mode": "persist+dump", "chunk_blocks": CHUNK_BLOCKS}
    return _Inputs(tmp, model, _prompts(), persist)


def _reference(inputs: _Inputs) -> EngineRun:
    """E0: every prompt on an engine without a connector (beside the store's engines), all of
    it in one process (the ``uni`` executor): the tokens of vLLM's default three processes
    (``test_tampered_store.py``'s U is such an engine) for a third of the start-up. Nothing of
    E0 but its tokens is read."""
    prompts = inputs.prompts
    return run_engine(inputs.tmp, "e0", inputs.model, list(prompts), prompts, executor="uni")


def _first_runs(inputs: _Inputs) -> Scenario:
    """E1, then E2 (TP=2): the store the later engines restart from."""
    tmp, model, prompts, persist = inputs.tmp, inputs.model, inputs.prompts, inputs.persist
    first = ["A", "B", "C", *SHARING]
    e1 = run_engine(tmp, "e1", model, first, prompts, connector=persist, no_persist=("C",))
    runs = {"e1": e1}
    store = Path(persist["path"])
    namespaces = [path for path in store.iterdir() if path.is_dir()]
    assert len(namespaces) == 1, namespaces
    bytes_after_e1 = {entry.path: entry.size for entry in _chunk_entries(store)}
    # E2's store is a slow disk: its saves are still being written when it shuts down, which
    # must finish them before vLLM stops its workers (the test reads every one).
    runs["e2"] = run_engine(
        tmp, "e2", model, ["A", "C"], prompts, connector=persist, tp=2, fsync_delay_s=E2_FSYNC_S
    )
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


def _store_runs(inputs: _Inputs) -> Scenario:
    """E1-E5 (``tests/engines/vllm/test_restarts.py`` describes them) on one store."""
    tmp, model, prompts, persist = inputs.tmp, inputs.model, inputs.prompts, inputs.persist
    scene = _first_runs(inputs)
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


def _with_reference(inputs: _Inputs, results: dict[str, Any]) -> Scenario:
    scene: Scenario = results["store"]
    scene.runs["e0"] = results["reference"]
    return scene


#: E0-E5 (``tests/engines/vllm/test_restarts.py`` describes them): E0 a job of its own, E1-E5
#: one chain on one store (E2 at TP=2 on a slow disk counts for about two engines).
WORLD = World(
    _prepare,
    {"reference": Job(_reference), "store": Job(_store_runs, engines=6)},
    _with_reference,
)


def perturbed_model(model: Path, directory: Path) -> Path:
    """A copy of ``model`` whose layer 1 ``k_proj`` is scaled by 1.25 (its keys change, its
    values and every layer before it do not), saved by the test process's transformers."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    with torch.no_grad():
        loaded.model.layers[1].self_attn.k_proj.weight.mul_(1.25)
    loaded.save_pretrained(directory)
    return directory


def _perturbed_run(inputs: _Inputs) -> EngineRun:
    """Prompt A on the perturbed model, dumped (``test_dumps.py`` locates the change)."""
    pytest.importorskip("transformers")
    model = perturbed_model(inputs.model, inputs.tmp / "perturbed-model")
    dumps = inputs.tmp / "dumps"
    connector = {"path": str(dumps), "mode": "dump"}
    return run_engine(inputs.tmp, "perturbed", model, ["A"], inputs.prompts, connector=connector)


#: The scenario's prompt A on a model whose layer 1 keys were changed: one engine, dumping.
PERTURBED = World(_prepare, {"run": Job(_perturbed_run)}, lambda inputs, results: results["run"])


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
