"""The kvsnap CLI contract, run for real on the built-in model.

Commands run through Typer's runner (in-process) and, for the installed entry point and the
"no traceback" promise, as subprocesses. Exit codes: 0 ok, 1 verification failed, 2 usage.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvsnap.cli.app import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]

CAPTURE_KEYS = {"path", "sequences", "tokens", "bytes", "seconds", "encoding"}
INSPECT_KEYS = {
    "format_version",
    "kvsnap_version",
    "model",
    "layout",
    "sequences",
    "num_blocks",
    "total_bytes",
}
LAYOUT_KEYS = {"num_layers", "num_kv_heads", "head_dim", "block_size", "dtype"}
VERIFY_KEYS = {"ok", "problems"}
RESTORE_KEYS = {"sequences", "bytes", "seconds", "continuations", "check"}


def run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def run_json(*args: str) -> tuple[int, dict]:
    code, out, _ = run(*args, "--json")
    return code, json.loads(out)  # the whole of stdout is one JSON object


@pytest.fixture(scope="module")
def snapshot_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "two.safetensors"
    code, payload = run_json(
        "capture", "-o", str(path), "-p", "The KV cache of a prompt", "-p", "Another prompt here"
    )
    assert code == 0, payload
    assert set(payload) == CAPTURE_KEYS
    assert payload["sequences"] == 2 and payload["tokens"] == 25 + 20
    assert payload["bytes"] == path.stat().st_size
    return path


def test_inspect_json_has_the_documented_keys(snapshot_path: Path, tmp_path: Path) -> None:
    plot = tmp_path / "norms.png"
    code, payload = run_json("inspect", str(snapshot_path), "--stats", "--plot", str(plot))
    assert code == 0
    assert INSPECT_KEYS <= set(payload)
    assert LAYOUT_KEYS <= set(payload["layout"])
    assert payload["layout"]["num_kv_heads"] == 2 and payload["layout"]["num_layers"] == 4
    assert [s["num_tokens"] for s in payload["sequences"]] == [25, 20]
    assert all({"id", "num_tokens", "num_blocks"} <= set(s) for s in payload["sequences"])
    assert payload["num_blocks"] == 4
    assert payload["total_bytes"] == 4 * 4 * 2 * 16 * 2 * 32 * 4
    assert set(payload["stats"]) == {f"layers.{i}.{p}" for i in range(4) for p in ("key", "value")}
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_table_for_people(snapshot_path: Path) -> None:
    code, out, _ = run("inspect", str(snapshot_path))
    assert code == 0
    assert "kvsnap/tiny-llama" in out and "seq-1" in out and "2 KV heads x 32" in out


def test_verify_and_recompute_pass_on_a_good_snapshot(snapshot_path: Path) -> None:
    code, payload = run_json("verify", str(snapshot_path), "--recompute")
    assert code == 0 and payload["ok"] and payload["problems"] == []
    # The comparison's numbers are in the JSON: a recompute on the CPU is bit-exact.
    layers = payload["comparison"]["layers"]
    assert len(layers) == 8 and all(layer["max_abs_diff"] == 0 for layer in layers)
    assert all(layer["cosine_min"] == 1 and layer["num_elements"] > 0 for layer in layers)


def test_verify_against_reports_the_first_mismatch(snapshot_path: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.safetensors"
    # The same prompts again: identical KV, so the comparison passes.
    code, _ = run_json(
        "capture", "-o", str(other), "-p", "The KV cache of a prompt", "-p", "Another prompt here"
    )
    assert code == 0
    code, payload = run_json("verify", str(snapshot_path), "--against", str(other))
    assert code == 0 and payload["ok"]
    different = tmp_path / "different.safetensors"
    code, _ = run_json(
        "capture",
        "-o",
        str(different),
        "-p",
        "The KV cache of a prompt",
        "-p",
        "Another prompt, changed",
    )
    assert code == 0
    code, payload = run_json("verify", str(snapshot_path), "--against", str(different))
    assert code == 1 and not payload["ok"]
    messages = " ".join(problem["message"] for problem in payload["problems"])
    assert "token ids differ" in messages and "seq-1" in messages
    mismatch = next(problem for problem in payload["problems"] if problem.get("first_mismatch"))
    # "Another prompt" is 14 bytes + BOS: the first differing token is 15.
    assert mismatch["first_mismatch"]["sequence"] == "seq-1"
    assert mismatch["first_mismatch"]["token"] == 15


def test_restore_check_matches_uninterrupted_generation(snapshot_path: Path) -> None:
    code, payload = run_json("restore", str(snapshot_path), "--max-new-tokens", "8", "--check")
    assert code == 0
    assert set(payload) == RESTORE_KEYS
    assert payload["check"] == "match" and payload["sequences"] == 2
    assert set(payload["continuations"]) == {"seq-0", "seq-1"}


def _corrupt_copy(source: Path, target: Path, offset_from_end: int) -> Path:
    data = bytearray(source.read_bytes())
    data[len(data) - offset_from_end] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


def test_corrupt_truncated_and_garbage_files_exit_1(snapshot_path: Path, tmp_path: Path) -> None:
    size = snapshot_path.stat().st_size
    corrupt = _corrupt_copy(snapshot_path, tmp_path / "corrupt.safetensors", size // 2)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(snapshot_path.read_bytes()[: size - 100])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(os.urandom(5000))
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    for path in (corrupt, truncated, garbage, empty):
        code, payload = run_json("verify", str(path))
        assert code == 1, path
        assert payload["ok"] is False and payload["problems"], path
        assert all(
            set(problem) >= {"tensor", "block", "message"} for problem in payload["problems"]
        )
    code, payload = run_json("verify", str(corrupt))
    named = [problem for problem in payload["problems"] if problem["tensor"]]
    assert named and named[0]["tensor"].startswith("layers.") and named[0]["block"] is not None
    code, out, err = run("inspect", str(garbage))
    assert code == 1 and "error" in err and "Traceback" not in out + err


def test_usage_errors_exit_2_with_one_message(snapshot_path: Path, tmp_path: Path) -> None:
    missing = tmp_path / "missing.safetensors"
    for args in (
        ("inspect", str(missing)),
        ("verify", str(missing)),
        ("restore", str(missing)),
        ("capture", "-o", str(tmp_path / "x.safetensors"), "--dtype", "int3"),
        ("capture", "-o", str(tmp_path / "x.safetensors"), "--prompts-file", str(missing)),
        ("capture", "-o", str(tmp_path / "x.safetensors"), "--model", str(tmp_path / "no-model")),
    ):
        code, out, err = run(*args)
        assert code == 2, (args, out, err)
        assert "Traceback" not in out + err and err.strip(), args
    code, payload = run_json("inspect", str(missing))
    assert code == 2 and payload["ok"] is False and "no such file" in payload["error"]
    code, _, _ = run("capture")  # -o is required: Typer's own usage error
    assert code == 2


def test_restore_into_a_different_geometry_is_refused_naming_both_sides(
    snapshot_path: Path, tmp_path: Path
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvsnap.engines.default_model import TINY_LLAMA_CONFIG

    config = LlamaConfig(**{**TINY_LLAMA_CONFIG, "num_key_value_heads": 1})
    torch.manual_seed(0)
    model_dir = tmp_path / "one-kv-head"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    code, out, err = run("restore", str(snapshot_path), "--model", str(model_dir))
    assert code == 2
    message = re.sub(r"\s+", " ", err)
    assert "num_kv_heads: snapshot 2, target 1" in message
    assert "Traceback" not in out + err


def test_entry_point_runs_and_never_prints_a_traceback(snapshot_path: Path, tmp_path: Path) -> None:
    kvsnap = Path(sys.executable).with_name("kvsnap")
    ok = subprocess.run(
        [kvsnap, "inspect", str(snapshot_path), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0 and json.loads(ok.stdout)["num_blocks"] == 4 and ok.stderr == ""
    bad = subprocess.run(
        [kvsnap, "verify", str(tmp_path / "nope")], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2 and "no such file" in bad.stderr and "Traceback" not in bad.stderr
    debug = subprocess.run(
        [kvsnap, "--debug", "inspect", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_docs_cli_md_documents_every_command_and_option() -> None:
    import typer.main

    text = (ROOT / "docs" / "cli.md").read_text()
    group = typer.main.get_command(app)
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    documented = {
        section.split("\n", 1)[0].strip("` ").removeprefix("kvsnap "): section
        for section in sections
    }
    for name, command in group.commands.items():
        assert name in documented, f"docs/cli.md has no section for `kvsnap {name}`"
        # A command group (``kvsnap store``) is documented in one section with its subcommands.
        subcommands = getattr(command, "commands", {})
        for subcommand in subcommands:
            assert f"`{subcommand}`" in documented[name], f"`kvsnap {name} {subcommand}` lacks"
        parameters = [p for sub in subcommands.values() for p in sub.params] or command.params
        for parameter in parameters:
            for flag in parameter.opts:
                if flag.startswith("-"):
                    assert flag in documented[name], f"docs/cli.md: `kvsnap {name}` lacks {flag}"
            if not parameter.opts[0].startswith("-"):
                assert parameter.name.upper() in documented[name], (
                    f"`kvsnap {name}` lacks {parameter.name.upper()}"
                )
        documented_flags = set(re.findall(r"`(--[a-z-]+)", documented[name]))
        real_flags = {
            flag for parameter in parameters for flag in parameter.opts if flag.startswith("--")
        }
        assert documented_flags <= real_flags, (
            f"`kvsnap {name}` documents options it lacks: {documented_flags - real_flags}"
        )
