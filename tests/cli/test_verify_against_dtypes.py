"""``kvsnap verify FP8 --against REFERENCE`` where the reference differs from the snapshot: of
another dtype (an fp8 snapshot of a bfloat16 cache against a float32 capture of the same
prompts), its error is measured against the reference in float64 (``kvsnap diff`` finds the
same differences), and a note says the recorded error is not checked against it; of another
block size or other sequences, one problem names the difference and how to compare instead (a
tolerance, which compares token by token). Real captures of the built-in model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli_runs import run_kvsnap

PROMPTS = ("-p", "The KV cache of a prompt, stored smaller", "-p", "Another prompt")


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The two prompts captured fp8 from a bfloat16 cache, plain in float32, plain in bfloat16
    with blocks of 8 tokens; and another prompt in float32."""
    folder = tmp_path_factory.mktemp("verify-dtypes")
    ways = {
        "fp8": ("--dtype", "bfloat16", "--compress", "fp8", *PROMPTS),
        "float32": ("--dtype", "float32", *PROMPTS),
        "blocks-of-8": ("--dtype", "bfloat16", "--block-size", "8", *PROMPTS),
        "other-prompts": ("--dtype", "float32", "-p", "Something else", "-p", "Another prompt"),
    }
    found = {}
    for name, options in ways.items():
        found[name] = folder / f"{name}.safetensors"
        run = run_kvsnap("capture", "-o", str(found[name]), "--reproducible", *options)
        assert run.returncode == 0, run.stderr
    return found


def _json(*args: str) -> tuple[int, dict]:
    run = run_kvsnap(*args, "--json")
    return run.returncode, json.loads(run.stdout)


def test_a_reference_of_another_dtype_is_measured_against_in_float64(captured):
    code, checked = _json("verify", str(captured["fp8"]), "--against", str(captured["float32"]))
    assert code == 0 and checked["ok"] and checked["problems"] == []
    measured, recorded = checked["error"]["measured"], checked["error"]["recorded"]
    # Against the float32 prefill, not the bfloat16 pages it was encoded from: another error,
    # of the same size (bfloat16's rounding and fp8's).
    assert measured != recorded and 0 < measured["rms_rel"] < 2 * recorded["rms_rel"]
    (note,) = checked["notes"]
    assert note.startswith("dtype: bfloat16 (the snapshot) vs float32 (the reference)")
    assert "measured in float64" in note and "not checked" in note
    # The same differences kvsnap diff finds comparing the two in float32.
    code, diff = _json("diff", str(captured["fp8"]), str(captured["float32"]))
    assert any(source["field"] == "dtype" for source in diff["sources"])
    largest = max(layer["max_abs_diff"] for layer in diff["layers"])
    assert measured["max_abs"] == pytest.approx(largest, rel=1e-5)
    text = run_kvsnap("verify", str(captured["fp8"]), "--against", str(captured["float32"]))
    assert text.returncode == 0 and "error measured against the reference" in text.stdout
    assert "note: dtype: bfloat16 (the snapshot) vs float32 (the reference)" in text.stdout


def test_a_reference_of_another_block_size_is_named_with_what_to_do(captured):
    code, checked = _json("verify", str(captured["fp8"]), "--against", str(captured["blocks-of-8"]))
    assert code == 1 and checked["error"]["measured"] is None
    (problem,) = checked["problems"]
    assert problem["message"].startswith("block size: 16 (the snapshot) vs 8 (the reference)")
    assert "--atol or --rtol" in problem["message"]
    # What it points to: with a tolerance the two compare token by token.
    code, compared = _json(
        "verify", str(captured["fp8"]), "--against", str(captured["blocks-of-8"]), "--atol", "1"
    )
    assert code == 0 and compared["ok"] and compared["comparison"]["layers"]


def test_a_reference_of_other_sequences_is_named_precisely(captured):
    code, checked = _json(
        "verify", str(captured["fp8"]), "--against", str(captured["other-prompts"])
    )
    assert code == 1 and checked["error"]["measured"] is None
    (problem,) = checked["problems"]
    assert problem["message"].startswith("sequence 'seq-0': its token ids differ")
