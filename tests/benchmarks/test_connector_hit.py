"""The connector-hit benchmark (``benchmarks/connector_hit.py``) run short: every request is a
real hit (the connector matched every loadable block, the worker loaded them bit-exact, the
save plan found them stored; the benchmark refuses anything else), timed in both settings."""

from __future__ import annotations

from benchmarks.connector_hit import BLOCKS_TIMED, connector_hit
from kvsnap.store.base import tuning


def test_a_short_run_times_real_hits_read_whole_and_in_pieces() -> None:
    bound = tuning.WHOLE_READ_MAX_BYTES
    result = connector_hit(num_layers=2, prompts=6, tokens=160)
    assert tuning.WHOLE_READ_MAX_BYTES == bound  # put back after the run
    assert (result["layers"], result["prompts"]) == (2, 4)
    assert set(result["ms"]) == {"read whole", "read in pieces"}
    for phases in result["ms"].values():
        assert set(phases) == set(BLOCKS_TIMED)
        assert all(median > 0 for median, _ in phases.values())


def test_calls_counts_what_a_request_read_whole_calls_in_the_match_and_the_load() -> None:
    result = connector_hit(num_layers=2, prompts=6, tokens=160, calls=True)
    assert set(result["calls"]) == {"match", "load"}
    for counts in result["calls"].values():
        assert 0 < counts["kvsnap"] < counts["all"]
        assert counts["kvsnap functions"] > 10


def test_a_sweep_before_each_request_leaves_the_hits_real() -> None:
    result = connector_hit(num_layers=2, prompts=4, tokens=160, sweep_mb=8)
    assert result["prompts"] == 2
    assert all(median > 0 for median, _ in result["ms"]["read whole"].values())
