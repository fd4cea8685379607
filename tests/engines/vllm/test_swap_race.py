"""The chunk checked is the chunk loaded: a co-writer renaming signed chunks over each other.

Two tenants send the same prompt under other ``cache_salt`` values, so their chunks have other
names and other KV (each computed into other blocks of a random cache). A second process (a
co-writer of the store without the key, ``tests/support/swap_chunks_child.py``) keeps renaming
each tenant's signed chunks over the other's names, and back, while the connector serves
requests of both tenants, alternating. Every block a request loads must be its own tenant's
KV: a chunk swapped before the scheduler's check is a miss there (another sequence id), one
swapped between the check and the worker's load is either loaded as checked (the worker in
the scheduler's process takes the very snapshot the scheduler checked) or refused by the
worker (which opens the chunk by its name, as a worker in another process does, and finds
another sequence than the one checked): a miss, recomputed, never foreign KV.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvsnap.engines.vllm import read_events
from kvsnap.format.signing import KeyRing
from kvsnap.store.files.keys import new_key_text
from tests.support.connector_requests import Connector, make_connector, random_prompt

HELPERS = Path(__file__).resolve().parents[2] / "support"
SOURCE_BLOCKS = {"x": [0, 1, 2, 3], "y": [4, 5, 6, 7]}
TARGET = [8, 9, 10, 11]


def _same(one: list[torch.Tensor], other: list[torch.Tensor]) -> bool:
    pairs = zip(one, other, strict=True)
    return all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in pairs)


def _race(tmp_path: Path, *, hand_over: bool, requests: int, verify: bool = True) -> dict[str, int]:
    """Serve ``requests`` requests, alternating tenants, while a second process swaps the
    tenants' chunks; how many hits, misses, foreign loads and worker misses there were."""
    keys = KeyRing([bytes.fromhex(new_key_text())])
    connector = make_connector(tmp_path / "store", keys=keys, hand_over=hand_over, verify=verify)
    prompt = random_prompt(seed=3)
    try:
        for tenant, blocks in SOURCE_BLOCKS.items():
            connector.store(f"store-{tenant}", prompt, blocks, salt=tenant)
        saves = [event for event in read_events(connector.events_path) if event["event"] == "save"]
        chunks = {
            tenant: [Path(save["path"]) for save in saves if save["request"] == f"store-{tenant}"]
            for tenant in SOURCE_BLOCKS
        }
        assert len(chunks["x"]) == len(chunks["y"]) == 2
        swapper, stop, progress = _start_swapper(tmp_path, chunks)
        try:
            counts = _serve_both(connector, prompt, requests, lambda: _renames(progress) >= 500)
        finally:
            stop.touch()
            out, _ = swapper.communicate(timeout=60)
        counts["renames"] = json.loads(out)["renames"]
        events = read_events(connector.events_path)
        counts["worker misses"] = sum(
            1 for event in events if event["event"] == "miss" and event["role"] == "worker"
        )
        return counts
    finally:
        connector.shutdown()


def _renames(progress: Path) -> int:
    """How many renames the co-writer has made so far (as it last wrote them down)."""
    try:
        return int(progress.read_text())
    except (FileNotFoundError, ValueError):
        return 0


def _start_swapper(
    tmp_path: Path, chunks: dict[str, list[Path]]
) -> tuple[subprocess.Popen[str], Path, Path]:
    """The co-writer, renaming tenant x's chunks over y's names and y's over x's, and back,
    from copies of each (its chunks, with their signatures); the file that stops it, and the
    file where it keeps its count of renames."""
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    copies = {}
    for tenant, names in chunks.items():
        for position, name in enumerate(names):
            copies[tenant, position] = pristine / f"{tenant}{position}.safetensors"
            shutil.copyfile(name, copies[tenant, position])
    pairs = [
        [str(name), str(copies[tenant, position]), str(copies[other, position])]
        for tenant, other in (("x", "y"), ("y", "x"))
        for position, name in enumerate(chunks[tenant])
    ]
    stop = tmp_path / "stop"
    job = tmp_path / "swap.json"
    progress = tmp_path / "renames"
    job.write_text(
        json.dumps(
            {"pairs": pairs, "pause_s": 0.0003, "stop": str(stop), "progress": str(progress)}
        )
    )
    process = subprocess.Popen(
        [sys.executable, str(HELPERS / "swap_chunks_child.py"), str(job)],
        stdout=subprocess.PIPE,
        text=True,
    )
    return process, stop, progress


def _serve_both(
    connector: Connector, prompt: list[int], requests: int, raced: Callable[[], bool]
) -> dict[str, int]:
    """Serve at least ``requests`` requests, alternating tenants, and on (up to ten times as
    many) until ``raced()``: on a loaded machine the co-writer may get too little of a core to
    rename often while the first ones are served."""
    sources = {tenant: connector.blocks(blocks) for tenant, blocks in SOURCE_BLOCKS.items()}
    counts = {"hits": 0, "misses": 0, "foreign": 0, "blocks loaded": 0}
    for number in range(10 * requests):
        if number >= requests and raced():
            break
        tenant = "xy"[number % 2]
        connector.scrub(TARGET)
        served = connector.serve(f"r{number}-{tenant}", prompt, TARGET, salt=tenant)
        counts["hits" if served.loaded else "misses"] += 1
        for position, block in enumerate(TARGET):
            if block not in served.loaded:
                continue
            counts["blocks loaded"] += 1
            own = [layer[position : position + 1] for layer in sources[tenant]]
            # Any KV but the tenant's own is foreign (the other tenant's, as it happens).
            counts["foreign"] += not _same(connector.blocks([block]), own)
    return counts


SETTINGS = [(True, True), (False, True), (False, False)]
NAMES = ["uni executor", "worker elsewhere", "worker elsewhere, verify_before_load off"]


@pytest.mark.parametrize(("hand_over", "verify"), SETTINGS, ids=NAMES)
def test_chunks_swapped_under_the_connector_never_load_another_tenants_kv(
    tmp_path: Path, hand_over: bool, verify: bool
) -> None:
    counts = _race(tmp_path, hand_over=hand_over, requests=500, verify=verify)
    assert counts["foreign"] == 0, counts
    # The race ran: the names changed hands hundreds of times, requests hit and missed.
    assert counts["renames"] > 500 and counts["hits"] > 20 and counts["misses"] > 20, counts


@pytest.mark.slow
@pytest.mark.parametrize(("hand_over", "verify"), SETTINGS, ids=NAMES)
def test_chunks_swapped_for_longer_never_load_another_tenants_kv(
    tmp_path: Path, hand_over: bool, verify: bool
) -> None:
    counts = _race(tmp_path, hand_over=hand_over, requests=5000, verify=verify)
    assert counts["foreign"] == 0, counts
    assert counts["hits"] > 200 and counts["misses"] > 200, counts
    if not hand_over:
        # A worker in another process opens the chunk by its name: some swaps fall between
        # the scheduler's check and the load, and the worker refuses them.
        assert counts["worker misses"] > 0, counts
