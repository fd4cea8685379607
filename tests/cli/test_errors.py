"""The CLI's promise for every mistake (docs/cli.md): one line on stderr, exit code 2, no
traceback, and with ``--json`` one JSON object ``{"ok": false, "error": ...}`` on stdout. Also:
URLs stay URLs, names from files are text (never rich markup), zero-token sequences inspect.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvsnap import format as fmt
from kvsnap.cli.app import app
from kvsnap.layout import KVGeometry
from kvsnap.snapshot import Snapshot
from tests.support.store_helpers import SOURCE, write_snapshot

runner = CliRunner()


def run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{args} raised {result.exception!r}"
    )
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A directory, a missing path, a synthetic fixture snapshot and a tiny-model snapshot."""
    root = tmp_path_factory.mktemp("cli-errors")
    fixture = root / "fixture.safetensors"
    code, _, err = run("fixture", str(fixture), "--lengths", "5,9", "--head-dim", "8")
    assert code == 0, err
    captured = root / "captured.safetensors"
    code, _, err = run("capture", "-o", str(captured), "-p", "hello")
    assert code == 0, err
    (root / "empty-prompts.txt").write_text("")
    (root / "blank-prompts.txt").write_text("\n  \n\t\n")
    return {
        "dir": str(root),
        "missing": str(root / "missing.safetensors"),
        "fixture": str(fixture),
        "captured": str(captured),
        "out": str(root / "out.safetensors"),
        "no_parent": str(root / "no" / "such" / "out.safetensors"),
        "empty_prompts": str(root / "empty-prompts.txt"),
        "blank_prompts": str(root / "blank-prompts.txt"),
    }


#: Each command with bad input: (case id, arguments with {placeholders} from ``files``).
BAD_INPUTS = [
    ("capture-device-gpu", "capture -o {out} --device gpu"),
    ("capture-device-cuda-99", "capture -o {out} --device cuda:99"),
    ("capture-backend-triton", "capture -o {out} --backend triton"),
    ("capture-backend-cuda-batch", "capture -o {out} --backend cuda-batch"),
    ("capture-backend-unknown", "capture -o {out} --backend fast"),
    ("capture-output-dir", "capture -o {dir}"),
    ("capture-output-no-parent", "capture -o {no_parent}"),
    ("capture-block-size-0", "capture -o {out} --block-size 0"),
    ("capture-missing-o", "capture"),
    ("capture-dtype", "capture -o {out} --dtype int3"),
    ("capture-prompts-file", "capture -o {out} --prompts-file {missing}"),
    ("capture-prompts-file-empty", "capture -o {out} --prompts-file {empty_prompts}"),
    ("capture-prompts-file-blank", "capture -o {out} --prompts-file {blank_prompts}"),
    ("capture-model-dir", "capture -o {out} --model {dir}/no-model"),
    ("inspect-missing", "inspect {missing}"),
    ("inspect-plot-no-extension", "inspect {fixture} --plot {dir}/noext"),
    ("inspect-plot-dir", "inspect {fixture} --plot {dir}"),
    ("inspect-unknown-sequence", "inspect {fixture} --plot {dir}/p.png --sequence nope"),
    ("inspect-sequence-without-plot", "inspect {fixture} --sequence seq-0"),
    ("verify-missing", "verify {missing}"),
    ("verify-dir", "verify {dir}"),
    ("verify-atol", "verify {fixture} --atol -1"),
    ("verify-against-missing", "verify {fixture} --against {missing}"),
    ("verify-recompute-device", "verify {captured} --recompute --device gpu"),
    ("verify-recompute-fixture", "verify {fixture} --recompute"),
    ("restore-missing", "restore {missing}"),
    ("restore-device", "restore {captured} --device gpu"),
    ("restore-backend", "restore {captured} --backend triton"),
    ("restore-max-new-tokens", "restore {captured} --max-new-tokens -1"),
    ("restore-fixture", "restore {fixture}"),
    ("fixture-output-dir", "fixture {dir}"),
    ("fixture-layers-0", "fixture {out} --layers 0"),
    ("fixture-dtype", "fixture {out} --dtype int3"),
    ("fixture-lengths", "fixture {out} --lengths x"),
    ("bench-device", "bench --device gpu"),
    ("bench-calibration-path", "bench --device cpu --calibration-path {dir}/c.json"),
    ("unknown-command", "nosuchcommand"),
    ("store-list-missing", "store list {missing}"),
    ("store-verify-missing", "store verify {missing}"),
    ("store-prune-missing-bytes", "store prune {dir}"),
    ("store-prune-negative", "store prune {dir} --max-bytes -1"),
    ("store-prune-bad-size", "store prune {dir} --max-bytes 1XB"),
    ("store-unknown-subcommand", "store nosuch {dir}"),
]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize(("case", "template"), BAD_INPUTS, ids=[case for case, _ in BAD_INPUTS])
def test_every_command_reports_bad_input_in_one_line_with_exit_2(
    files: dict[str, str], case: str, template: str, as_json: bool
) -> None:
    args = template.format(**files).split()
    code, out, err = run(*args, *(["--json"] if as_json else []))
    assert code == 2, (case, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (case, err)
    assert "Traceback" not in out + err
    if as_json:
        payload = json.loads(out)  # the whole of stdout is one JSON object
        assert payload["ok"] is False and payload["error"] == lines[0].removeprefix("error: ")
    else:
        assert out == ""
    assert not Path(files["out"]).exists(), "a refused command wrote its output"


def test_the_messages_say_what_is_wrong(files: dict[str, str]) -> None:
    def error(*args: str) -> str:
        return run(*args)[2]

    assert "is a directory" in error("capture", "-o", files["dir"])
    assert "a prompt must not be empty" in error("capture", "-o", files["out"], "--prompt", "")
    assert f"--prompts-file {files['empty_prompts']}: no prompt in it" in error(
        "capture", "-o", files["out"], "--prompts-file", files["empty_prompts"]
    )
    assert "is a directory" in error("fixture", files["dir"])
    assert "is a directory" in error("verify", files["dir"])  # inspect DIR lists it
    assert "a directory is listed on its own" in error("inspect", files["fixture"], files["dir"])
    assert "not a torch device" in error("capture", "-o", files["out"], "--device", "gpu")
    assert "--backend triton cannot run with --device cpu" in error(
        "capture", "-o", files["out"], "--backend", "triton"
    )
    missing_model = f"{files['dir']}/no-model"
    assert f"model directory {missing_model} does not exist" in error(
        "capture", "-o", files["out"], "--model", missing_model
    )
    assert "model directory ./no-model does not exist" in error(
        "capture", "-o", files["out"], "--model", "./no-model"
    )
    recompute = error("verify", files["fixture"], "--recompute")
    assert "outside the vocabulary of model 'kvsnap/tiny-llama' (259 ids)" in recompute
    assert "kvsnap fixture" in recompute
    assert "name an image file ending in .png" in error(
        "inspect", files["fixture"], "--plot", f"{files['dir']}/noext"
    )
    assert not Path(f"{files['dir']}/noext.png").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
@pytest.mark.parametrize("command", ["capture -o {out}", "restore {captured}", "verify {captured}"])
def test_device_cuda_without_cuda_is_a_usage_error(files: dict[str, str], command: str) -> None:
    args = command.format(**files).split()
    if args[0] == "verify":
        args.append("--recompute")
    code, out, err = run(*args, "--device", "cuda")
    assert code == 2 and "CUDA is not available" in err and out == ""


def test_missing_transformers_names_the_extra(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    for name in [name for name in sys.modules if name.startswith("kvsnap.engines.transformers")]:
        monkeypatch.delitem(sys.modules, name)
    for args in (
        ("capture", "-o", files["out"]),
        ("restore", files["captured"]),
        ("verify", files["captured"], "--recompute"),
    ):
        code, payload = _json(*args)
        assert code == 2 and "pip install 'kvsnap[transformers]'" in payload["error"], args


def _json(*args: str) -> tuple[int, dict]:
    code, out, _ = run(*args, "--json")
    return code, json.loads(out)


def _saved_model(directory: Path, **changes: object) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvsnap.engines.default_model import TINY_LLAMA_CONFIG

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA_CONFIG, **changes})).save_pretrained(directory)
    return directory


def test_a_snapshot_of_another_model_names_it_and_the_model_option(tmp_path: Path) -> None:
    model_dir = _saved_model(tmp_path / "two-layers", num_hidden_layers=2)
    snapshot = tmp_path / "two.safetensors"
    code, out, err = run("capture", "-o", str(snapshot), "--model", str(model_dir))
    assert code == 0, err
    for args in (("restore", str(snapshot)), ("verify", str(snapshot), "--recompute")):
        code, out, err = run(*args)
        assert code == 2, (args, out)
        message = " ".join(err.split())
        assert f"captured from model '{model_dir}': pass --model {model_dir}" in message
    code, _, err = run("restore", str(snapshot), "--model", str(model_dir), "--max-new-tokens", "2")
    assert code == 0, err


def test_json_runs_print_nothing_on_stderr_not_even_the_weight_loading_bar(
    tmp_path: Path,
) -> None:
    model_dir = _saved_model(tmp_path / "model")
    kvsnap = Path(sys.executable).with_name("kvsnap")
    result = subprocess.run(
        [kvsnap, "capture", "-o", str(tmp_path / "s.safetensors"), "-m", str(model_dir), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0 and json.loads(result.stdout)["sequences"] == 1
    assert result.stderr == ""


# --------------------------------------------------------------------------------------------
# verify --against: sequence ids, counts and lengths


def _capture(path: Path, *prompts: str) -> str:
    arguments = [part for prompt in prompts for part in ("-p", prompt)]
    code, _, err = run("capture", "-o", str(path), *arguments)
    assert code == 0, err
    return str(path)


def test_verify_against_compares_sequence_counts_and_lengths(tmp_path: Path) -> None:
    two = _capture(tmp_path / "two.safetensors", "Hello there, longer", "Second")
    one = _capture(tmp_path / "one.safetensors", "Hello")
    code, payload = _json("verify", two, "--against", one)
    assert code == 1 and not payload["ok"]
    messages = [problem["message"] for problem in payload["problems"]]
    assert f"{two} holds 2 sequence(s), {one} holds 1" in messages
    assert f"sequence 'seq-1' is only in {two}" in messages
    assert any("sequence 'seq-0': 20 tokens in" in message for message in messages)
    assert len(messages) == len(set(messages)), "a problem is reported twice"
    assert not any("target" in message for message in messages)
    # People see each problem exactly once too.
    code, out, _ = run("verify", two, "--against", one)
    assert code == 1
    flat = " ".join(out.split())  # the report wraps at 100 columns
    assert flat.count(f"is only in {two}") == 1 and flat.count("20 tokens in") == 1


def test_verify_against_names_token_differences_once_not_per_layer(tmp_path: Path) -> None:
    a = _capture(tmp_path / "a.safetensors", "The same length A")
    b = _capture(tmp_path / "b.safetensors", "The same length B")
    code, payload = _json("verify", a, "--against", b)
    assert code == 1
    token_messages = [p for p in payload["problems"] if "token ids differ" in p["message"]]
    assert [p["message"] for p in token_messages] == [
        "sequence 'seq-0': token ids differ from token 17"
    ]


def test_verify_against_another_geometry_has_no_restore_wording(
    files: dict[str, str],
) -> None:
    code, payload = _json("verify", files["captured"], "--against", files["fixture"])
    assert code == 1
    [problem] = payload["problems"]
    assert "differ in KV geometry" in problem["message"] and "target" not in problem["message"]


# --------------------------------------------------------------------------------------------
# URLs


def test_file_urls_are_passed_to_the_library(files: dict[str, str], tmp_path: Path) -> None:
    url = f"file://{files['fixture']}"
    code, payload = _json("inspect", url)
    assert code == 0 and payload["path"] == url and len(payload["sequences"]) == 2
    code, payload = _json("verify", url, "--against", f"file://{files['fixture']}")
    assert code == 0 and payload["ok"]
    written = tmp_path / "by-url.safetensors"
    code, payload = _json("capture", "-o", f"file://{written}", "-p", "via a URL")
    assert code == 0 and written.is_file()
    code, payload = _json("fixture", f"file://{tmp_path}/fixture.safetensors")
    assert code == 0 and (tmp_path / "fixture.safetensors").is_file()
    assert len(payload["sha256"]) == 64


def test_memory_urls_are_passed_to_the_library() -> None:
    code, payload = _json("fixture", "memory://kvsnap-cli/m.safetensors", "--lengths", "5")
    assert code == 0
    code, payload = _json("inspect", "memory://kvsnap-cli/m.safetensors")
    assert code == 0 and payload["sequences"][0]["num_tokens"] == 5


# --------------------------------------------------------------------------------------------
# Names from files and paths are text, never rich markup; zero-token sequences


def _custom_snapshot(
    path: Path, ids: list[str], lengths: list[int], model_id: str, fill: Callable | None = None
) -> Path:
    """A float32 snapshot written through the store, with any sequence ids and lengths."""
    geometry = KVGeometry(num_layers=2, block_size=4, dtype="float32", num_kv_heads=2, head_dim=8)
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, 200, size=length, dtype=np.int64) for length in lengths]
    chains = [fmt.prefix_hash_chain(row, geometry.block_size) for row in tokens]
    dedupe = fmt.dedupe_blocks(chains)
    records = [
        fmt.SequenceRecord(sequence_id, row, blocks, tuple(chain))
        for sequence_id, row, blocks, chain in zip(
            ids, tokens, dedupe.sequence_block_ids, chains, strict=True
        )
    ]
    metadata = fmt.SnapshotMetadata(
        geometry=geometry,
        source=dataclasses.replace(SOURCE, model_id=model_id),
        sequences=records,
        num_blocks=dedupe.num_blocks,
        capture_encoding="test-layout",
        tp_size=1,
    )
    values = rng.standard_normal(
        (dedupe.num_blocks, *geometry.canonical_page_shape), dtype=np.float32
    )
    if fill is not None:
        fill(values)
    pages = {name: values.view(np.uint8).reshape(-1) for name in geometry.tensor_names()}
    write_snapshot(path, metadata, pages)
    return path


MARKUP_IDS = ["seq[/]", "user[admin]", "[bold]x[/bold]"]


def test_names_from_files_and_paths_print_as_themselves(tmp_path: Path) -> None:
    directory = tmp_path / "a[/x]"  # the directory "x]" inside "a["
    directory.mkdir(parents=True)
    snapshot = _custom_snapshot(directory / "s.safetensors", MARKUP_IDS, [5, 6, 7], "m[/i]")
    code, out, err = run("inspect", str(snapshot), "--stats")
    assert code == 0, err
    flat = "".join(out.split())
    for name in (*MARKUP_IDS, "m[/i]", "a[/x]"):
        assert "".join(name.split()) in flat, name
    code, out, err = run("verify", str(snapshot), "--against", str(snapshot))
    assert code == 0 and "OK" in out, err
    plot = directory / "p[1].png"
    code, out, err = run("inspect", str(snapshot), "--plot", str(plot), "--sequence", "seq[/]")
    assert code == 0 and plot.is_file() and str(plot) in out.replace("\n", ""), err
    other = _custom_snapshot(directory / "t.safetensors", ["user[admin]"], [3], "m[/i]")
    code, out, err = run("verify", str(snapshot), "--against", str(other))
    assert code == 1 and f"sequence 'seq[/]' is only in {snapshot}" in " ".join(out.split())


def test_an_error_names_a_bracketed_file_exactly(tmp_path: Path) -> None:
    missing = tmp_path / "snap[v2].safetensors"
    code, _, err = run("inspect", str(missing))
    assert code == 2 and f"{missing}: no such file" in err
    missing.write_bytes(b"not a snapshot at all, not even close to one")
    code, _, err = run("inspect", str(missing))
    assert code == 1 and "snap[v2].safetensors" in err


def test_zero_token_sequences_inspect_with_stats_and_plot(tmp_path: Path) -> None:
    snapshot = _custom_snapshot(tmp_path / "z.safetensors", ["empty", "full"], [0, 6], "m")
    with Snapshot.open(snapshot) as snap:
        assert snap.verify() == []
        assert snap.token_norms("empty")["key"].shape == (2, 0)
        assert snap.valid_tokens_per_block().tolist() == [4, 2]
    code, _, err = run("inspect", str(snapshot), "--stats", "--plot", str(tmp_path / "z.png"))
    assert code == 0 and (tmp_path / "z.png").is_file(), err
    code, payload = _json("inspect", str(snapshot), "--stats")
    assert code == 0 and payload["sequences"][0]["num_tokens"] == 0
    assert payload["stats"]["layers.0.key"]["absmax"] > 0
    plot = tmp_path / "empty.svg"
    code, _, err = run("inspect", str(snapshot), "--plot", str(plot), "--sequence", "empty")
    assert code == 0 and plot.read_text().startswith("<?xml"), err
    only_empty = _custom_snapshot(tmp_path / "e.safetensors", ["empty"], [0], "m")
    code, payload = _json("inspect", str(only_empty), "--stats", "--plot", str(tmp_path / "e.png"))
    assert code == 0 and payload["stats"]["layers.1.value"] == {
        "absmax": 0.0,
        "mean": 0.0,
        "std": 0.0,
        "nan": 0,
        "inf": 0,
    }


# --------------------------------------------------------------------------------------------
# The plot


def test_plot_writes_exactly_the_path_given_and_labels_nan_and_inf(tmp_path: Path) -> None:
    def poison(values: np.ndarray) -> None:
        values[0, 1, 0, 0] = np.nan  # block 0 of every tensor: tokens of "s"
        values[0, 2, 1, 3] = np.inf
        values[0, 3, 0, 0] = 1e6  # one outlier that must not wash out the scale

    snapshot = _custom_snapshot(tmp_path / "n.safetensors", ["s"], [4], "model-x", fill=poison)
    plot = tmp_path / "norms.svg"
    code, payload = _json("inspect", str(snapshot), "--plot", str(plot))
    assert code == 0 and payload["plot"] == str(plot)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["n.safetensors", "norms.svg"]
    svg = plot.read_text()
    for label in ("NaN (2)", "Inf (2)", "n.safetensors: model model-x, sequence s (4 tokens)"):
        assert label in svg, label  # 2 = one token in each of the two layers
    assert "key norm (outliers clipped)" in svg


@pytest.mark.parametrize("count", [20, 200])
def test_plot_scale_ignores_one_outlier(count: int) -> None:
    from kvsnap.cli.plot import _scale

    values = np.concatenate([np.linspace(1.0, 2.0, count), [1e6]])
    low, high = _scale(values)
    assert 1.0 <= low < 1.1 and 1.9 < high < 6.0


def test_help_renders_flags_as_documented() -> None:
    code, out, _ = run("capture", "--help")
    assert code == 0
    assert "<bool>" not in out and "<list[str]>" not in out and "<str>" not in out
    assert "TEXT" in out and "INTEGER" in out


def test_fixture_shows_progress_on_a_terminal_and_none_with_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from rich.console import Console

    from kvsnap.cli import output

    terminal = io.StringIO()
    monkeypatch.setattr(output, "stderr", Console(file=terminal, force_terminal=True, width=100))
    code, out, _ = run("fixture", str(tmp_path / "a.safetensors"), "--lengths", "300,200")
    assert code == 0 and "wrote 2 synthetic sequence(s)" in out
    assert "writing" in terminal.getvalue()  # the byte progress bar, drawn on "stderr"
    terminal.truncate(0)
    code, out, _ = run("fixture", str(tmp_path / "b.safetensors"), "--lengths", "300", "--json")
    assert code == 0 and json.loads(out)["tokens"] == 300
    assert terminal.getvalue() == ""


def test_verify_against_pairs_differently_named_sequences_by_position(tmp_path: Path) -> None:
    a = _custom_snapshot(tmp_path / "a.safetensors", ["req-17"], [6], "m")
    b = _custom_snapshot(tmp_path / "b.safetensors", ["seq-0"], [6], "m")
    code, payload = _json("verify", str(a), "--against", str(b))
    assert code == 0 and payload["ok"] and payload["problems"] == []
    assert payload["notes"] == [
        "no sequence id is in both snapshots ('req-17' vs 'seq-0'): sequences compared by position"
    ]


def test_click_usage_errors_say_each_thing_once() -> None:
    code, out, err = run("restor")
    assert code == 2 and out == ""
    assert err.strip() == (
        "error: No such command 'restor'. Did you mean 'restore', 'store'? (see kvsnap --help)"
    )
    code, out, err = run("capturee")
    assert code == 2 and out == ""
    assert err.strip() == (
        "error: No such command 'capturee'. Did you mean 'capture'? (see kvsnap --help)"
    )
    code, out, err = run()
    assert code == 2 and "Usage: kvsnap" in out and err == ""
