"""The path-restore benchmark (``benchmarks/path_restore_cost.py``) run short on this tree: each
snapshot, plain, lossless and fp8, is restored by path in a fresh process of the tree and timed;
nothing is refused."""

from __future__ import annotations

from benchmarks import path_restore_cost


def test_the_benchmark_times_every_snapshot_of_this_tree(capsys):
    rows = path_restore_cost.main(["--rounds", "1", "--calls", "3"])
    assert [row["snapshot"] for row in rows] == ["plain", "lossless", "fp8"]
    for row in rows:
        assert "refused" not in row and row["rounds"] == 1
        assert row["wall_us"] > 0 and row["cpu_us"] > 0
    assert "plain" in capsys.readouterr().out
