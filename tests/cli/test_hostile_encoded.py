"""Hostile encoded files through the CLI: a corrupt chunk, scales that are NaN, zero or infinite,
chunk tables that overlap or run past the data, a decoded size of 2**60, a decoded header naming
a shard, page checks of the wrong length, a changed fp8 page. Each file is consistent around its
one bad field (its trailer recomputed: tests/support/encoded_tamper.py). ``verify`` says what is
wrong in one problem line and exits 1 (``--json``: one problem, ``ok`` false), ``convert``
writes nothing and exits 1 with one line, ``inspect`` exits 1 with one line for whatever its
open reads; never a traceback. A real process under a 2 GiB address-space limit refuses a
decoded size of 16 GiB the same way (nothing sized by it is allocated)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvsnap.cli.app import app
from kvsnap.encoded.write import encode_file
from kvsnap.format import encoded as enc
from tests.support.encoded_files import capture_real
from tests.support.encoded_tamper import (
    StoredParts,
    original_header,
    set_original_metadata,
    stored_parts,
    write_parts,
)

REPOSITORY = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _table(parts: StoredParts, name: str = "layers.0.key") -> np.ndarray:
    chunks = name + enc.CHUNKS_SUFFIX
    shape = next(shape for stored, _, shape, _ in parts.tensors if stored == chunks)
    return parts.array(chunks).view("<u8").reshape(shape)


def _scale(value: float) -> Callable[[StoredParts], None]:
    def poison(parts: StoredParts) -> None:
        parts.array("layers.1.key" + enc.SCALES_SUFFIX).view("<f4")[5] = value

    return poison


def _flip(name: str, at: int) -> Callable[[StoredParts], None]:
    def flip(parts: StoredParts) -> None:
        parts.array(name)[at] ^= 0x40

    return flip


def _overlap(parts: StoredParts) -> None:
    _table(parts)[0, 5] += 7  # plane 0 of chunk 0 claims bytes of plane 1


def _past(parts: StoredParts) -> None:
    _table(parts)[-1, 2] += 1 << 40  # the last chunk starts a terabyte on


def _claims(size: int) -> Callable[[StoredParts], None]:
    def claim(parts: StoredParts) -> None:
        parts.document["encoding"]["decoded_bytes"] = size

    return claim


def _shard(parts: StoredParts) -> None:
    _, metadata, _ = original_header(parts)
    set_original_metadata(parts, {**metadata, "shard": {"index": 1, "count": 2}})


def _short_checks(parts: StoredParts) -> None:
    name = "layers.2.value" + enc.PAGES_SUFFIX
    parts.replace(name, "U64", (9,), parts.array(name)[:72])


#: (case, encoded file, change, what the one problem says, whether inspect's open finds it).
CASES = [
    ("corrupt-chunk", "lossless", _flip("layers.1.value", 100), "do not match their checksum", 1),
    ("nan-scale", "fp8", _scale(float("nan")), "fp8 scale of head 1 is nan", 1),
    ("zero-scale", "fp8", _scale(0.0), "fp8 scale of head 1 is 0 ", 1),
    ("infinite-scale", "fp8", _scale(float("inf")), "fp8 scale of head 1 is inf", 1),
    ("overlapping-chunks", "lossless", _overlap, "the chunks fill", 1),
    ("chunks-past-the-data", "lossless", _past, "starts at byte", 1),
    ("decoded-2**60", "lossless", _claims(2**60), f"decoded_bytes = {2**60} bytes", 1),
    ("shard-header", "lossless", _shard, "holds a shard or part file", 1),
    ("short-page-checks", "fp8", _short_checks, "stored as U64 (9,), expected U64 (10,)", 1),
    # The open of an fp8 file reads no page (inspect shows it): verify and convert check them.
    ("changed-fp8-page", "fp8", _flip("layers.3.key", 2048 + 5), "page checksum mismatch", 0),
]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hostile-cli")
    source = folder / "kv.safetensors"
    capture_real(source, "vllm-nhd", torch.bfloat16)
    for encoding in ("lossless", "fp8"):
        encode_file(source, folder / f"{encoding}.safetensors", encoding)
    files = {}
    for case, encoding, change, _, _ in CASES:
        parts = stored_parts(folder / f"{encoding}.safetensors")
        change(parts)
        files[case] = write_parts(parts, folder / f"{case}.safetensors")
    return files


def _invoke(*args: str):
    result = runner.invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    for stream in (result.stdout, result.stderr):
        assert "Traceback" not in stream
    return result


@pytest.mark.parametrize(("case", "words", "inspect_code"), [(c[0], c[3], c[4]) for c in CASES])
def test_each_is_one_problem_and_exit_1(hostile, tmp_path, case, words, inspect_code):
    path = str(hostile[case])
    verified = _invoke("verify", path)
    assert verified.exit_code == 1
    problems = [line for line in verified.stdout.splitlines() if line.startswith("problem:")]
    assert len(problems) == 1 and words in problems[0], verified.stdout
    assert problems[0].startswith(f"problem: {path}"), problems[0]  # the file first
    assert "FAILED (1 problem(s))" in verified.stdout
    as_json = _invoke("verify", path, "--json")
    payload = json.loads(as_json.stdout)
    assert as_json.exit_code == 1 and payload["ok"] is False
    assert [words in problem["message"] for problem in payload["problems"]] == [True]
    out = tmp_path / "out.safetensors"
    converted = _invoke("convert", path, "-o", str(out), "--compress", "none")
    assert converted.exit_code == 1 and not out.exists()
    assert len(converted.stderr.strip().splitlines()) == 1 and words in converted.stderr
    inspected = _invoke("inspect", path)
    assert inspected.exit_code == inspect_code
    if inspect_code:
        assert inspected.stderr.startswith(f"error: {path}") and words in inspected.stderr
        assert len(inspected.stderr.strip().splitlines()) == 1


def test_a_real_process_refuses_a_16_gib_claim_within_2_gib_of_address_space(hostile, tmp_path):
    # Before the decoded size was checked, decode made np.zeros(decoded_bytes): under this limit
    # a MemoryError and its traceback. The parts are the lossless file with one number changed.
    parts = stored_parts(hostile["corrupt-chunk"].parent / "lossless.safetensors")
    _claims(16 << 30)(parts)
    path = write_parts(parts, tmp_path / "claims.safetensors")

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    for command in (["verify", str(path)], ["inspect", str(path)]):
        done = subprocess.run(
            [sys.executable, "-m", "kvsnap.cli", *command],
            cwd=REPOSITORY,
            env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
            preexec_fn=limited,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr + done.stdout
        assert f"decoded_bytes = {16 << 30} bytes" in done.stdout + done.stderr
