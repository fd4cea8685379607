"""The analysis benchmark (``benchmarks/analysis_speed.py``) run small: it writes its two
snapshots, measures ``inspect --stats`` and ``diff`` of this tree as fresh processes, and
reports their time and peak memory (a tree without ``diff`` is measured with ``verify
--against``)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import analysis_speed


def test_a_small_run_measures_both_commands(tmp_path: Path) -> None:
    rows = analysis_speed.main(["--gib", "0.02", "--runs", "1", "--work", str(tmp_path)])
    assert [row["command"] for row in rows] == ["inspect --stats", "diff"]
    for row in rows:
        assert 0.015 * (1 << 30) < row["snapshot_bytes"] < 0.03 * (1 << 30)
        assert row["wall_s_median"] > 0 and row["cpu_s_median"] > 0
        # Neither imports torch nor holds the snapshot: far below 256 MiB.
        assert 20 < row["peak_rss_mib"] < 256
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
