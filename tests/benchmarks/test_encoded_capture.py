"""The encoded-capture benchmark (``benchmarks/encoded_capture.py``) run small: both fp8
captures write the same file, and the direct one's time is its spans'."""

from __future__ import annotations

from pathlib import Path

from benchmarks import encoded_capture


def test_a_small_run_times_three_captures_of_one_cache(tmp_path: Path) -> None:
    args = ["--layers", "2", "--tokens", "64", "--repeat", "1", "--dir", str(tmp_path)]
    results = encoded_capture.main(args)
    assert results["same_file"] is True and results["kv_mib"] == 0.5
    for name in ("capture_bf16_ms", "capture_fp8_ms", "capture_fp8_via_file_ms"):
        assert results[name] > 0
    spans = results["spans_ms"]
    assert set(spans) == {"encoded.setup", "encoded.tensor", "encoded.digests", "encoded.write"}
    assert sum(spans.values()) <= results["capture_fp8_ms"]
    assert list(tmp_path.iterdir()) == []
