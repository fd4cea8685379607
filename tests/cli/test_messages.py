"""Every message true (issue 38, items 4 and 6): advice names only options the command has,
and names the model once; a head split that cannot be right is refused; a temporary file is
called a write in progress; ``store verify`` of plain snapshots does not say OK; a failed
``restore --check`` says which sequence, where, and what the reference produced; the help
shows whole sentences, argument descriptions and plain defaults."""

from __future__ import annotations

import fcntl
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import typer.main
from typer.testing import CliRunner

from kvsnap.cli.app import app
from kvsnap.engines.default_model import build_default_model

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
LLAMA = REPO / "fixtures" / "foreign" / "llama-state"
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def command_flags(arguments: list[str]) -> set[str]:
    """The options of the (sub)command ``arguments`` invoke, and the global ones."""
    command = typer.main.get_command(app)
    flags = {opt for param in command.params for opt in param.opts}
    for word in arguments:
        sub = getattr(command, "commands", {}).get(word)
        if sub is None:
            break
        command = sub
        flags |= {opt for param in command.params for opt in param.opts}
    return flags | {"--help"}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A capture from a saved base model, a fine-tune of it, a converted llama.cpp state, a
    folder of plain snapshots, and a fixture."""
    directory = tmp_path_factory.mktemp("messages")
    model = build_default_model()
    model.save_pretrained(directory / "base")
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    model.save_pretrained(directory / "tuned")
    paths = {"base": directory / "base", "tuned": directory / "tuned"}
    paths["capture"] = directory / "base.safetensors"
    code, _, err = run(
        "capture", "-o", str(paths["capture"]), "-m", str(paths["base"]), "-p", "the first prompt"
    )
    assert code == 0, err
    paths["llama"] = directory / "llama.safetensors"
    code, _, err = run(
        "convert", str(LLAMA / "seq-noflash.bin"), "--kv-heads", "2", "-o", str(paths["llama"])
    )
    assert code == 0, err
    paths["plain"] = directory / "plain"
    paths["plain"].mkdir()
    shutil.copy(paths["capture"], paths["plain"] / "a.safetensors")
    paths["fixture"] = directory / "fixture.safetensors"
    assert run("fixture", str(paths["fixture"]), "--lengths", "9")[0] == 0
    return paths


def _error_scenarios(files: dict[str, Path], tmp: Path) -> list[list[str]]:
    """Commands that fail with advice, one per message that gives any."""
    capture, fixture = str(files["capture"]), str(files["fixture"])
    out = str(tmp / "out.safetensors")
    return [
        ["verify", capture, "--recompute", "-m", str(files["tuned"])],
        ["verify", str(files["llama"]), "--recompute"],
        ["restore", capture, "-m", str(files["tuned"])],
        ["restore", fixture],
        ["restore", str(files["llama"])],
        ["inspect", capture, "--sequence", "seq-0"],
        ["inspect", capture, "--model", str(files["base"])],
        ["diff", capture, capture, "--sequence", "seq-0"],
        ["capture", "-o", out, "--chat", "--tokens", str(LLAMA / "prompt.json")],
        ["capture", "-o", out, "-p", "x" * 5000],
        ["convert", str(LLAMA / "seq-noflash.bin"), "--kv-heads", "32", "-o", out],
        ["convert", str(LLAMA / "seq-noflash.bin"), "-o", out],
        ["verify", str(LLAMA / "seq-noflash.bin"), "--against", capture],
        ["inspect", str(LLAMA / "seq-noflash.bin"), "--stats"],
        ["store", "verify", str(files["plain"])],
        ["store", "list", str(tmp / "no-store")],
        ["verify", capture, "--key-file", str(tmp / "no-key")],
    ]


def test_every_option_an_error_suggests_exists_on_that_command(
    files: dict[str, Path], tmp_path: Path
) -> None:
    suggested = 0
    for arguments in _error_scenarios(files, tmp_path):
        code, out, err = run(*arguments)
        assert code != 0, (arguments, out)
        flags = set(FLAG.findall(err))
        missing = flags - command_flags(arguments)
        assert not missing, f"`kvsnap {' '.join(arguments[:2])}` suggests {missing}: {err}"
        suggested += len(flags)
    assert suggested >= 10  # the scenarios do give advice


def test_every_option_named_in_a_cli_message_exists_somewhere() -> None:
    """Each ``--flag`` written in the CLI's sources is an option of some command: a message
    cannot advise one that does not exist (the scenarios above check the command too)."""
    command = typer.main.get_command(app)
    known = {"--help"}
    stack = [command]
    while stack:
        current = stack.pop()
        known |= {opt for param in current.params for opt in param.opts}
        stack += list(getattr(current, "commands", {}).values())
    named = {
        flag for path in (REPO / "cli").glob("*.py") for flag in FLAG.findall(path.read_text())
    }
    assert named - known == set(), named - known


def test_recompute_on_a_fine_tune_gives_verify_advice_naming_the_model_once(
    files: dict[str, Path],
) -> None:
    code, _, err = run("verify", str(files["capture"]), "--recompute", "-m", str(files["tuned"]))
    message = " ".join(err.split())
    assert code == 2 and "fingerprint" in message
    assert "--force" not in message  # verify has no --force
    assert message.count("captured from model") == 1
    assert f"pass --model {files['base']}" in message
    code, _, err = run("restore", str(files["capture"]), "-m", str(files["tuned"]))
    assert code == 2 and "--force to restore anyway" in err  # restore has one


def test_a_snapshot_that_names_no_model_is_not_told_to_use_model_unknown(
    files: dict[str, Path],
) -> None:
    code, _, err = run("verify", str(files["llama"]), "--recompute")
    message = " ".join(err.split())
    assert code == 2 and "--model unknown" not in message
    assert "does not record which model" in message and "--model DIR" in message


def test_convert_refuses_a_head_split_that_cannot_be_right(
    files: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out.safetensors"
    seq = str(LLAMA / "seq-noflash.bin")
    code, _, err = run("convert", seq, "--kv-heads", "32", "-o", str(out))
    assert code == 2 and not out.exists()
    assert "32 KV heads of 1 dimensions" in " ".join(err.split())
    # A model config given: its KV heads are taken, and a split against it refused.
    model = tmp_path / "model"
    model.mkdir()
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_size": 64}
    (model / "config.json").write_text(json.dumps(config))
    code, _, err = run("convert", seq, "-m", str(model), "-o", str(out))
    assert code == 0, err
    code, _, err = run("convert", seq, "-m", str(model), "--kv-heads", "4", "-o", str(out))
    assert code == 2 and "the model config has 2 KV heads of 16" in " ".join(err.split())


def test_a_temporary_file_is_a_write_in_progress(files: dict[str, Path], tmp_path: Path) -> None:
    temp = tmp_path / ".a.safetensors.kvsnap-tmp-12345-0123456789abcdef"
    temp.write_bytes(files["capture"].read_bytes()[:1000])
    with temp.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # what a live writer holds until its rename
        code, _, err = run("inspect", str(temp))
        assert code == 2 and "a write in progress" in err and "a.safetensors" in err
        assert "checksum" not in err
    code, _, err = run("verify", str(temp))
    assert code == 2 and "did not finish" in err


def test_store_verify_of_plain_snapshots_does_not_say_ok(files: dict[str, Path]) -> None:
    code, out, err = run("store", "verify", str(files["plain"]))
    assert code == 2 and "OK" not in out
    assert "plain snapshot file(s)" in err and "kvsnap verify FILE" in err


def test_a_failed_check_says_which_sequence_where_and_what_the_reference_made(
    files: dict[str, Path],
) -> None:
    arguments = ["restore", str(files["capture"]), "-m", str(files["tuned"]), "--force"]
    result = runner.invoke(app, [*arguments, "--check", "--max-new-tokens", "12", "--json"])
    payload = json.loads(result.stdout)
    assert result.exit_code == 1 and payload["check"] == "mismatch"
    [mismatch] = payload["mismatches"]
    first = mismatch["first_differing_token"]
    assert mismatch["sequence"] == "seq-0"
    assert mismatch["restored_ids"][:first] == mismatch["reference_ids"][:first]
    assert mismatch["restored_ids"][first] != mismatch["reference_ids"][first]
    assert mismatch["restored"] == payload["continuations"]["seq-0"]
    code, out, _ = run(*arguments, "--check", "--max-new-tokens", "12")
    assert code == 1
    assert f"sequence seq-0: generated token {first} differs; restored → " in " ".join(out.split())
    assert "without the snapshot →" in out


def test_help_shows_whole_sentences_argument_help_and_plain_defaults() -> None:
    wide = {"COLUMNS": "120"}
    listing = runner.invoke(app, ["--help"], env=wide).stdout
    rows = [line for line in listing.splitlines() if line.startswith("│ ") and "│" in line[2:]]
    summaries = [line.strip("│ ").strip() for line in rows]
    for name in ("capture", "inspect", "verify", "diff", "restore"):
        [summary] = [line for line in summaries if line.startswith(f"{name} ")]
        assert summary.endswith("."), summary  # a whole sentence on its line
    assert not any(line and line[0].islower() and " " not in line[:9] for line in summaries[1:])
    for command in ("inspect", "verify", "restore"):
        text = runner.invoke(app, [command, "--help"], env=wide).stdout
        assert re.search(r"snapshot\s+(TEXT|SNAPSHOT\.\.\.)\s+Snapshot files? or URL", text), text
    prune = runner.invoke(app, ["store", "prune", "--help"], env=wide).stdout
    assert "(600)" not in prune and "default 600 s." in " ".join(prune.split())
