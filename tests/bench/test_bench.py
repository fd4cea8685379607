"""``kvsnap bench`` and :mod:`kvsnap.bench`, run for real on host memory (``--device cpu``).

The figures of a CPU run say nothing about GPUs; these tests check the matrix, the numbers'
sanity, the calibration derived and written, that ``auto`` picks the written calibration up in
this process and in a fresh one, and the clean refusal without CUDA.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvsnap.bench import Measurement, derive_calibration
from kvsnap.bench.calibration import write_calibration
from kvsnap.cli.app import app
from kvsnap.transfer import AutoPolicy, available_backends, current_policy, load_policy
from kvsnap.transfer.plan import Direction
from kvsnap.transfer.policy import policy_from_calibration

runner = CliRunner()
KiB, MiB = 1 << 10, 1 << 20
D2H, H2D = Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE
CUDA = torch.device("cuda", 0)
EVERY_GPU_BACKEND = {"cuda-batch", "triton", "torch"}
BENCH_KEYS = {
    "device",
    "device_name",
    "quick",
    "smoke_test",
    "torch",
    "backends",
    "auto_policy",
    "seconds",
    "results",
    "calibration",
    "calibration_path",
}


def expected_jobs() -> set[tuple[int, int]]:
    """(page bytes, blocks) of a quick run: 64 and 32768 blocks, cut to 16 MiB per job of two
    layers of K and V pages."""
    pages = (2 * KiB, 16 * KiB, 128 * KiB, 2 * MiB)
    return {(page, min(count, 16 * MiB // (page * 4))) for page in pages for count in (64, 32768)}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    calibration = tmp_path_factory.mktemp("bench") / "calibration.json"
    result = runner.invoke(
        app,
        [
            "bench",
            "--device",
            "cpu",
            "--quick",
            "--write-calibration",
            "--calibration-path",
            str(calibration),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stdout + result.stderr
    return json.loads(result.stdout), calibration  # the whole of stdout is one JSON object


def test_json_has_every_row_with_positive_figures(quick_run: tuple[dict, Path]) -> None:
    payload, _ = quick_run
    assert set(payload) == BENCH_KEYS
    assert payload["device"] == "cpu" and payload["smoke_test"] is True and payload["quick"]
    backends = payload["backends"]
    assert backends[0] == "auto" and set(backends[1:]) == set(available_backends("cpu"))
    methods = {"ceiling", *(f"kvsnap-{name}" for name in backends)}
    rows: dict[tuple[int, int, str], dict[str, dict]] = {}
    for row in payload["results"]:
        assert row["layout"] == "vllm-nhd"
        key = (row["page_bytes"], row["blocks"], row["direction"])
        rows.setdefault(key, {})[row["method"]] = row
    assert set(rows) == {
        (page, blocks, d.value) for page, blocks in expected_jobs() for d in Direction
    }
    for (page, blocks, _), by_method in rows.items():
        assert set(by_method) == methods
        for row in by_method.values():
            assert row["note"] is None, row
            assert row["num_bytes"] == page * blocks * 4  # two layers, key and value
            assert row["seconds"] > 0 and row["gbps"] > 0 and row["ratio_to_ceiling"] > 0
            assert row["gbps"] == pytest.approx(row["num_bytes"] / row["seconds"] / 1e9)
        assert by_method["ceiling"]["ratio_to_ceiling"] == 1.0
        assert by_method["kvsnap-auto"]["backend_used"] == "cpu"  # auto without CUDA
        assert by_method["kvsnap-torch"]["backend_used"] == "torch"
        assert by_method["kvsnap-torch"]["host_us_per_block"] > 0


def test_write_calibration_writes_what_auto_loads(quick_run: tuple[dict, Path]) -> None:
    payload, path = quick_run
    assert payload["calibration_path"] == str(path)
    written = json.loads(path.read_text())
    assert written == payload["calibration"]
    policy = load_policy(path)
    assert policy.source == str(path)
    # Host memory has no batch copy: it never takes over, up to 4x the largest page (2 MiB).
    assert dict(policy.large_fragment_bytes) == {D2H: 8 * MiB, H2D: 8 * MiB}
    assert policy.small_backend == "torch" and written["measured_on"] == payload["device_name"]
    # The built-in defaults send 2 MiB fragments to the batch copy; this calibration does not.
    assert AutoPolicy().choose(CUDA, D2H, 2 * MiB, available=EVERY_GPU_BACKEND) == "cuda-batch"
    assert policy.choose(CUDA, D2H, 2 * MiB, available=EVERY_GPU_BACKEND) == "torch"


def test_a_fresh_process_picks_the_written_calibration_up(quick_run: tuple[dict, Path]) -> None:
    _, path = quick_run
    probe = (
        "import json, torch\n"
        "from kvsnap.transfer.plan import Direction\n"
        "from kvsnap.transfer import current_policy\n"
        "policy = current_policy()\n"
        "choice = policy.choose(torch.device('cuda', 0), Direction.DEVICE_TO_HOST, 2 << 20,\n"
        "                       available={'cuda-batch', 'triton', 'torch'})\n"
        "print(json.dumps({'source': policy.source, 'choice': choice}))\n"
    )
    env = {**os.environ, "KVSNAP_CALIBRATION": str(path)}
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(result.stdout) == {"source": str(path), "choice": "torch"}


def test_table_for_people_names_rows_backends_and_the_smoke_test(tmp_path: Path) -> None:
    result = runner.invoke(app, ["bench", "--device", "cpu", "--quick"])
    assert result.exit_code == 0, result.stdout + result.stderr
    out = result.stdout
    assert "smoke test" in out and "say nothing about GPU" in out
    # The hint names options that work from --device cpu: following it writes the file.
    hint = "not written: --write-calibration --calibration-path FILE writes it to FILE"
    assert hint in out
    target = tmp_path / "cpu-calibration.json"
    options = ["--write-calibration", "--calibration-path", str(target)]
    followed = runner.invoke(app, ["bench", "--device", "cpu", "--quick", *options])
    assert followed.exit_code == 0, followed.stdout + followed.stderr
    assert json.loads(target.read_text())["small_backend"]
    assert "derived calibration (from host memory: not for GPUs)" in out
    rows = [line.split() for line in out.splitlines()]
    # page, unit, blocks, direction, ceiling, then "GB/s (ratio)" per backend, auto's pick after
    # its own.
    seen = set()
    for cells in rows:
        if len(cells) < 5 or cells[1] not in ("KiB", "MiB"):
            continue
        page = int(cells[0]) * (KiB if cells[1] == "KiB" else MiB)
        seen.add((page, int(cells[2]), cells[3]))
        assert float(cells[4]) > 0  # the ceiling
        gbps = [float(cell) for cell in cells[5:] if cell[0].isdigit()]
        ratios = [float(cell.strip("()")) for cell in cells[5:] if cell.startswith("(")]
        assert len(gbps) == len(ratios) == len(available_backends("cpu")) + 1  # and auto
        assert all(value > 0 for value in gbps) and all(value >= 0 for value in ratios)
        assert cells[7] == "cpu"  # auto's pick, after its GB/s and ratio
    directions = {"device→host", "host→device"}
    assert seen == {(page, blocks, d) for page, blocks in expected_jobs() for d in directions}


def _measurement(
    page: int, blocks: int, direction: Direction, method: str, gbps: float | None
) -> Measurement:
    seconds = None if gbps is None else 1.0
    return Measurement("vllm-nhd", page, blocks, direction.value, method, 0, seconds, gbps)


def test_derive_calibration_from_the_largest_vllm_jobs() -> None:
    results = []
    for direction, batch_from in ((D2H, 128 * KiB), (H2D, 2 * MiB)):
        for page in (2 * KiB, 16 * KiB, 128 * KiB, 2 * MiB):
            # 98% of triton from ``batch_from`` (enough to take over), 90% below it.
            batch_gbps = 49.0 if page >= batch_from else 45.0
            results += [
                _measurement(page, 4096, direction, "kvsnap-triton", 50.0),
                _measurement(page, 4096, direction, "kvsnap-torch", 40.0),
                _measurement(page, 4096, direction, "kvsnap-cuda-batch", batch_gbps),
                # A smaller job and another layout never count, nor does a failed measurement.
                _measurement(page, 64, direction, "kvsnap-cuda-batch", 99.0),
                _measurement(page, 4096, direction, "kvsnap-auto", None),
            ]
        packed = _measurement(2 * KiB, 4096, direction, "kvsnap-cuda-batch", 99.0)
        results.append(dataclasses.replace(packed, layout="packed"))
    calibration = derive_calibration(results, "test GPU")
    assert calibration["large_fragment_bytes"] == {D2H.value: 128 * KiB, H2D.value: 2 * MiB}
    assert calibration["small_backend"] == "triton" and calibration["measured_on"] == "test GPU"
    policy_from_calibration(calibration)  # what auto accepts

    torch_wins = [_measurement(16 * KiB, 64, D2H, "kvsnap-torch", 5.0)]
    assert derive_calibration(torch_wins, "x")["small_backend"] == "torch"
    # Without a batch copy it never takes over; without any small backend, the default stays.
    nothing = derive_calibration([_measurement(2 * MiB, 8, D2H, "kvsnap-auto", 1.0)], "x")
    assert nothing["large_fragment_bytes"][D2H.value] == 8 * MiB
    assert nothing["small_backend"] == "torch"


def test_write_calibration_changes_auto_in_this_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "auto.json"
    monkeypatch.setenv("KVSNAP_CALIBRATION", str(path))
    before = current_policy()  # cached for this path: the defaults, as no file exists yet
    assert before.source == "built-in defaults"
    calibration = {
        "version": 1,
        "large_fragment_bytes": {D2H.value: 128 * KiB, H2D.value: 2 * MiB},
        "small_backend": "triton",
    }
    assert write_calibration(calibration) == path
    after = current_policy()
    assert after.source == str(path) and after.small_backend == "triton"
    assert after.choose(CUDA, D2H, 128 * KiB, available=EVERY_GPU_BACKEND) == "cuda-batch"
    assert after.choose(CUDA, D2H, 64 * KiB, available=EVERY_GPU_BACKEND) == "triton"
    assert before.choose(CUDA, D2H, 128 * KiB, available=EVERY_GPU_BACKEND) == "torch"
    with pytest.raises(ValueError, match="version"):
        write_calibration({"version": 2}, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["auto.json"]  # no partial file left behind


def test_without_cuda_bench_fails_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = runner.invoke(app, ["bench"])
    assert result.exit_code == 2
    assert "no CUDA device" in result.stderr and "--device cpu" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr and result.stdout == ""
    result = runner.invoke(app, ["bench", "--quick", "--json"])
    assert result.exit_code == 2
    payload = json.loads(result.stdout)
    assert payload["ok"] is False and "no CUDA device" in payload["error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_module_entry_point_without_cuda_prints_one_error_and_no_traceback() -> None:
    command = [sys.executable, "-m", "kvsnap.cli", "bench", "--quick"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "cpu", "--write-calibration"], "--calibration-path"),
        (["--device", "cpu", "--calibration-path", "x.json"], "--write-calibration"),
        (["--device", "mps"], "cuda or cpu"),
        (["--device", "not-a-device"], "not a torch device"),
        (
            ["--device", "cpu", "--write-calibration", "--calibration-path", "/"],
            "cannot write the calibration",
        ),
        (
            [
                "--device",
                "cpu",
                "--write-calibration",
                "--calibration-path",
                "/proc/kvsnap-no-such-dir/calibration.json",
            ],
            "cannot write the calibration",
        ),
    ],
)
def test_usage_errors_exit_2_before_measuring(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.stdout + result.stderr
    assert "GB/s" not in result.stdout  # refused before anything was measured


def test_the_library_never_imports_its_test_helpers() -> None:
    # kvsnap.bench measures through the library alone; kvsnap.testing is for tests (issue 12).
    probe = (
        "import sys\n"
        "import kvsnap.bench, kvsnap.layout, kvsnap.snapshot\n"
        "print(sorted(name for name in sys.modules if name.startswith('kvsnap.testing')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
