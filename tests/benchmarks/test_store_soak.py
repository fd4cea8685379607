"""The store soak (``benchmarks/store_soak.py``) run short: engines sharing one store at its
bound, some SIGKILLed, must never load wrong KV, never fail a load, hold the bound within one
chunk at every sample and leave no temporary file."""

from __future__ import annotations

from pathlib import Path

from benchmarks import store_soak


def test_short_soak_keeps_a_shared_store_sound(tmp_path: Path) -> None:
    report = store_soak.main(
        [
            *("--processes", "4", "--duration", "10", "--kill-every", "3"),
            *("--capacity-chunks", "24", "--prompts", "400", "--policy", "fail"),
            *("--work", str(tmp_path), "--out", str(tmp_path / "soak.json")),
        ]
    )
    # It did what it soaks: loads, saves, evictions, kills.
    assert report["kills"] >= 2 and report["loads"] > 0 and report["loaded_blocks"] > 0
    assert report["evictions"] > 0 and report["saves"] > report["capacity_chunks"]
    assert report["wrong_kv"] == 0
    assert report["failed_loads"] == 0
    assert report["max_over_bound_chunks"] <= 1
    assert report["temp_files_left"] == 0 and report["final_chunks_bytes_within_bound"]
