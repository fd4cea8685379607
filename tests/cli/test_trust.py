"""The command line's side of store trust: signing and checking with --key-file, told apart from
corruption, and a fine-tune refused the base model's KV."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvsnap.cli.app import app
from kvsnap.engines.default_model import build_default_model
from tests.support.cli_runs import new_key_file
from tests.support.tamper import RawSnapshot

runner = CliRunner()


def run(*args: str) -> tuple[int, dict]:
    result = runner.invoke(app, [*args, "--json"])
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A snapshot signed with one key, an unsigned one, and the key file."""
    directory = tmp_path_factory.mktemp("cli-trust")
    key = new_key_file(directory / "store.key")
    signed_path, plain_path = directory / "signed.safetensors", directory / "plain.safetensors"
    code, _ = run("capture", "-o", str(signed_path), "-p", "signed prompt", "--key-file", str(key))
    assert code == 0
    code, _ = run("capture", "-o", str(plain_path), "-p", "signed prompt")
    assert code == 0
    return signed_path, plain_path, key


def test_capture_signs_and_inspect_names_the_key(signed) -> None:
    signed_path, plain_path, _ = signed
    code, described = run("inspect", str(signed_path))
    assert code == 0 and described["signature"]["algorithm"] == "hmac-sha256-blake3"
    assert described["signature"]["page_binding"] == "blake3"
    assert described["signature"]["binding"] == "pages bound by BLAKE3"
    (key_id,) = set(described["signature"]["key_ids"])
    assert len(key_id) == 32
    code, described = run("inspect", str(plain_path))
    assert described["signature"] == {
        "algorithm": None,
        "key_ids": [None],
        "page_binding": None,
        "binding": None,
    }
    result = runner.invoke(app, ["inspect", str(signed_path)], env={"COLUMNS": "240"})
    assert "hmac-sha256-blake3 by key" in result.stdout
    assert "pages bound by BLAKE3" in result.stdout


def test_verify_tells_a_valid_an_unsigned_and_a_badly_signed_snapshot_apart(
    signed, tmp_path: Path
) -> None:
    signed_path, plain_path, key = signed
    assert run("verify", str(signed_path), "--key-file", str(key)) == (
        0,
        {"ok": True, "problems": [], "signature": "valid"},
    )
    code, report = run("verify", str(plain_path), "--key-file", str(key))
    assert code == 1 and report["signature"] == "unsigned"
    assert [problem["kind"] for problem in report["problems"]] == ["unsigned"]
    other = new_key_file(tmp_path / "other.key")
    code, report = run("verify", str(signed_path), "--key-file", str(other))
    assert code == 1 and report["signature"] == "bad signature"
    assert "not one of ours" in report["problems"][0]["message"]
    # Rotation: the old key after the new one still verifies.
    code, report = run("verify", str(signed_path), "--key-file", str(other), "--key-file", str(key))
    assert code == 0 and report["signature"] == "valid"
    # A page changed after signing: the signature still passes (it covers every byte but the
    # pages), and the page is named by its BLAKE3 digest.
    damaged = tmp_path / "damaged.safetensors"
    raw = RawSnapshot(signed_path)
    raw.page("layers.1.value", 0)[100] ^= 0xFF
    raw.path = damaged
    raw.save()
    code, report = run("verify", str(damaged), "--key-file", str(key))
    assert code == 1 and report["signature"] == "valid"
    (problem,) = report["problems"]
    assert (problem["tensor"], problem["block"]) == ("layers.1.value", 0)
    assert "BLAKE3" in problem["message"] and "kind" not in problem
    # Anything else changed breaks the signature, reported as such (the checksums as well).
    raw = RawSnapshot(signed_path)
    raw.array("sequences.0.token_ids", "<i8")[0] += 1
    raw.path = damaged
    raw.save()
    code, report = run("verify", str(damaged), "--key-file", str(key))
    assert code == 1 and report["signature"] == "bad signature"
    kinds = [problem.get("kind") for problem in report["problems"]]
    assert kinds[0] == "bad signature" and None in kinds


def test_restore_with_a_key_refuses_a_page_changed_after_signing(signed, tmp_path: Path) -> None:
    signed_path, _, key = signed
    damaged = tmp_path / "damaged.safetensors"
    raw = RawSnapshot(signed_path)
    raw.page("layers.0.key", 0)[7] ^= 0x01
    raw.path = damaged
    raw.save()
    result = runner.invoke(app, ["restore", str(damaged), "--key-file", str(key)])
    assert result.exit_code == 1, result.output
    assert "BLAKE3" in result.stderr and "layers.0.key" in result.stderr
    assert "Traceback" not in result.stderr


def test_restore_with_a_key_refuses_an_unsigned_snapshot_in_one_line(signed) -> None:
    _, plain_path, key = signed
    result = runner.invoke(app, ["restore", str(plain_path), "--key-file", str(key)])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "unsigned" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_key_file_others_can_read_is_refused_with_the_fix(signed, tmp_path: Path) -> None:
    signed_path, _, key = signed
    loose = tmp_path / "loose.key"
    loose.write_text(key.read_text())
    loose.chmod(0o644)
    result = runner.invoke(app, ["verify", str(signed_path), "--key-file", str(loose)])
    assert result.exit_code == 2 and f"chmod 600 {loose}" in result.stderr


def test_restore_into_a_fine_tune_is_refused_naming_both_fingerprints(tmp_path: Path) -> None:
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    model = build_default_model()
    model.save_pretrained(base)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.01)
    model.save_pretrained(tuned)
    snapshot = tmp_path / "base.safetensors"
    code, _ = run("capture", "-o", str(snapshot), "--model", str(base), "-p", "a system prompt")
    assert code == 0
    _, base_info = run("inspect", str(snapshot))
    result = runner.invoke(app, ["restore", str(snapshot), "--model", str(tuned)])
    assert result.exit_code == 2
    assert base_info["model"]["fingerprint"][:16] in result.stderr
    assert "fingerprint" in result.stderr and "--force" in result.stderr
    forced = runner.invoke(app, ["restore", str(snapshot), "--model", str(tuned), "--force"])
    assert forced.exit_code == 0, forced.stderr
