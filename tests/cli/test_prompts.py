"""Prompts as a user holds them (issue 38): token ids from a file (``capture --tokens``), the
model's chat template (``--chat``), a follow-up after a restored prefix (``restore --prompt``),
a sequence's prompt shown as text (``inspect --text``), and several snapshots or a directory
of them at once (``inspect``, ``verify``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsnap.cli.app import app
from kvsnap.engines import transformers as kt
from kvsnap.engines.default_model import load_model
from kvsnap.snapshot import Snapshot
from tests.support.small_models import CHAT_TEMPLATE, save_model, save_tokenizer

runner = CliRunner()


def run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def run_json(*args: str) -> tuple[int, dict]:
    code, out, err = run(*args, "--json")
    assert out, err
    return code, json.loads(out)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = save_model(tmp_path_factory.mktemp("chat") / "model", "llama")
    save_tokenizer(directory)
    return directory


def test_capture_takes_token_ids_from_files(tmp_path: Path) -> None:
    one = tmp_path / "one.json"
    one.write_text("[256, 72, 105, 33]")
    several = tmp_path / "several.txt"
    several.write_text("256 1 2 3\n\n256, 9, 8\n")
    output = tmp_path / "ids.safetensors"
    code, payload = run_json(
        "capture", "-o", str(output), "--tokens", str(one), "--tokens", str(several)
    )
    assert code == 0 and payload["sequences"] == 3
    with Snapshot.open(output) as snap:
        assert [record.token_ids.tolist() for record in snap.sequences] == [
            [256, 72, 105, 33],
            [256, 1, 2, 3],
            [256, 9, 8],
        ]
    # The KV is the model's for those ids: the same as a prompt that encodes to them.
    text_capture = tmp_path / "text.safetensors"
    assert run("capture", "-o", str(text_capture), "-p", "Hi!")[0] == 0
    with Snapshot.open(output) as ids, Snapshot.open(text_capture) as text:
        first = ids.sequence_kv("seq-0", "layers.3.value")
        assert (first == text.sequence_kv("seq-0", "layers.3.value")).all()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, -2]", "non-negative integers"),
        ("one two", "non-negative integers"),
        ("[]", "no token ids"),
        ("[[1, 2], []]", "no token ids"),
        ("[1, 300]", "token id 300, outside the vocabulary"),
    ],
)
def test_bad_token_files_are_refused_in_one_line(
    tmp_path: Path, content: str, message: str
) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(content)
    code, _, err = run("capture", "-o", str(tmp_path / "x.safetensors"), "--tokens", str(tokens))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_chat_wraps_the_prompt_in_the_models_template(chat_model: Path, tmp_path: Path) -> None:
    output = tmp_path / "chat.safetensors"
    code, _, err = run(
        "capture", "-o", str(output), "-m", str(chat_model), "-p", "Hello world", "--chat"
    )
    assert code == 0, err
    loaded = load_model(str(chat_model))
    templated = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello world"}], add_generation_prompt=True, tokenize=False
    )
    assert templated == "<|user|>Hello world\n<|assistant|>"
    expected = loaded.tokenizer.encode(templated, add_special_tokens=False)
    with Snapshot.open(output) as snap:
        assert snap.sequences[0].token_ids.tolist() == expected
    assert CHAT_TEMPLATE  # the template the tokenizer was saved with
    # A model without a chat template is refused, before any prefill.
    code, _, err = run("capture", "-o", str(output), "-p", "Hello", "--chat")
    assert code == 2 and "has no chat template" in err


def test_restore_runs_a_follow_up_after_the_restored_prefix(tmp_path: Path) -> None:
    prefix = "A system prompt worth keeping."
    snapshot = tmp_path / "prefix.safetensors"
    assert run("capture", "-o", str(snapshot), "-p", prefix)[0] == 0
    follow_up = " And a question about it?"
    code, payload = run_json(
        "restore", str(snapshot), "--prompt", follow_up, "--max-new-tokens", "6", "--check"
    )
    assert code == 0 and payload["check"] == "match" and payload["prompt"] == follow_up
    # What it generated is what the model generates after prefix + follow-up from scratch.
    model = load_model()
    whole = model.encode(prefix) + model.encode_follow_up(follow_up)
    assert payload["continuations"]["seq-0"] == model.decode(kt.generate_greedy(model, whole, 6))
    code, out, _ = run("restore", str(snapshot), "--prompt", follow_up, "--max-new-tokens", "2")
    assert code == 0 and "follow-up: ' And a question about it?'" in out


def test_inspect_text_shows_each_prompt(chat_model: Path, tmp_path: Path) -> None:
    builtin = tmp_path / "builtin.safetensors"
    assert run("capture", "-o", str(builtin), "-p", "The first prompt", "-p", "Second")[0] == 0
    code, payload = run_json("inspect", str(builtin), "--text")
    assert code == 0 and [s["text"] for s in payload["sequences"]] == ["The first prompt", "Second"]
    code, out, _ = run("inspect", str(builtin), "--text")
    assert "seq-0: 'The first prompt'" in out and "seq-1: 'Second'" in out
    # A local model's own tokenizer decodes its snapshot.
    own = tmp_path / "own.safetensors"
    assert run("capture", "-o", str(own), "-m", str(chat_model), "-p", "Hello world")[0] == 0
    code, payload = run_json("inspect", str(own), "--text")
    assert code == 0 and payload["sequences"][0]["text"] == "Hello world"
    # No tokenizer at hand: one line saying what to pass.
    code, _, err = run("inspect", str(own), "--text", "--model", str(tmp_path / "nothing"))
    assert code == 2 and "--text: no tokenizer" in err and "pass --model" in err


def test_several_snapshots_and_a_directory(tmp_path: Path) -> None:
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert run("capture", "-o", str(first), "-p", "one")[0] == 0
    assert run("fixture", str(second), "--lengths", "5,7")[0] == 0
    code, payload = run_json("inspect", str(first), str(second))
    assert code == 0 and [len(s["sequences"]) for s in payload["snapshots"]] == [1, 2]
    code, payload = run_json("verify", str(first), str(second))
    assert (
        code == 0
        and payload["ok"]
        and [f["path"] for f in payload["files"]]
        == [
            str(first),
            str(second),
        ]
    )
    damaged = tmp_path / "c.safetensors"
    data = bytearray(second.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    code, payload = run_json("verify", str(first), str(damaged))
    assert code == 1 and [f["ok"] for f in payload["files"]] == [True, False]
    code, out, _ = run("verify", str(first), str(damaged))
    assert code == 1 and "1 of 2 ok" in out
    # A directory is listed: each snapshot once, a damaged header named, no temporary file.
    (tmp_path / ".d.safetensors.kvsnap-tmp-1-0123456789abcdef").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("not a snapshot")
    code, payload = run_json("inspect", str(tmp_path))
    assert code == 0 and payload["count"] == 3
    rows = {Path(row["path"]).name: row for row in payload["snapshots"]}
    assert set(rows) == {"a.safetensors", "b.safetensors", "c.safetensors"}
    assert rows["a.safetensors"]["tokens"] == 4 and rows["b.safetensors"]["sequences"] == 2
    code, out, _ = run("inspect", str(tmp_path))
    assert code == 0 and "3 snapshot(s)" in out and "kvsnap/tiny-llama" in out
