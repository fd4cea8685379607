"""A capture is never silently of something else (issue 38, "a capture can be silently
wrong"): transformers 5 returns an empty tokenizer for a model directory without tokenizer
files instead of failing, which encoded a 77-character prompt of a Gemma2 as one ``<unk>`` and
a Qwen2's as nothing. Such a model gets byte ids, with one note; a prompt the tokenizer drops
is refused; a sequence longer than the model's positions is refused unless forced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsnap.cli.app import app
from kvsnap.engines import transformers as kt
from kvsnap.engines.default_model import ByteTokenizer, load_model
from kvsnap.errors import ModelLoadError
from kvsnap.snapshot import Snapshot
from tests.support.small_models import save_model, save_tokenizer

runner = CliRunner()
PROMPT = "A prompt of seventy-seven characters, written as a user would write it, so..."


@pytest.mark.parametrize("kind", ["gemma2", "qwen2", "llama"])
def test_a_model_without_tokenizer_files_gets_byte_ids_and_one_note(
    kind: str, tmp_path: Path
) -> None:
    assert len(PROMPT) == 77
    directory = save_model(tmp_path / kind, kind)
    loaded = load_model(str(directory))
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    [note] = loaded.notes
    assert "no working tokenizer" in note and str(directory) in note
    output = tmp_path / "captured.safetensors"
    result = runner.invoke(app, ["capture", "-o", str(output), "-m", str(directory), "-p", PROMPT])
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("no working tokenizer") == 1
    with Snapshot.open(output) as snap:
        [record] = snap.sequences
        # BOS and one id per byte: the prompt, whole.
        assert record.token_ids.tolist() == ByteTokenizer().encode(PROMPT)
    # With --json the note is in the JSON, and stderr stays empty.
    result = runner.invoke(
        app, ["capture", "-o", str(output), "-m", str(directory), "-p", PROMPT, "--json"]
    )
    payload = json.loads(result.stdout)
    assert result.exit_code == 0 and result.stderr == ""
    assert "no working tokenizer" in payload["notes"][0]


def test_a_model_too_small_for_byte_ids_is_refused_in_one_line(tmp_path: Path) -> None:
    directory = save_model(tmp_path / "small", "qwen2", vocab_size=200)
    with pytest.raises(ModelLoadError, match=r"no working tokenizer .* vocabulary of 200 ids"):
        load_model(str(directory))
    result = runner.invoke(
        app, ["capture", "-o", str(tmp_path / "x.safetensors"), "-m", str(directory)]
    )
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert "no working tokenizer" in line and "add its tokenizer files" in line


def test_a_working_tokenizer_is_kept_and_a_prompt_it_drops_is_refused(tmp_path: Path) -> None:
    directory = save_model(tmp_path / "model", "llama")
    save_tokenizer(directory, words=True)  # knows the corpus's words, nothing else
    loaded = load_model(str(directory))
    assert not isinstance(loaded.tokenizer, ByteTokenizer) and loaded.notes == []
    # Text it knows: kept whole.
    [(_, ids)] = kt.prefill(loaded, ["Hello world , the quick brown fox ."])
    assert "Hello world" in loaded.decode(ids)
    # Words it does not know are <unk>: refused, not captured as unknown tokens.
    with pytest.raises(ValueError, match="encodes to unknown tokens only"):
        kt.prefill(loaded, ["漢字 zyx"])
    # Mostly unknown: its tokens decode to less than half of it.
    with pytest.raises(ValueError, match=r"decode to \d+ of its \d+ characters"):
        kt.prefill(loaded, ["the unrecognisable gibberishness"])
    capture = ["capture", "-o", str(tmp_path / "x.safetensors"), "-m", str(directory)]
    result = runner.invoke(app, [*capture, "-p", "漢字 zyx"])
    assert (
        result.exit_code == 2 and "--prompt '漢字 zyx' encodes to unknown tokens" in result.stderr
    )


def test_a_prompt_longer_than_the_positions_is_refused_or_warned_when_forced(
    tmp_path: Path,
) -> None:
    directory = save_model(tmp_path / "model", "llama", max_position_embeddings=512)
    prompt = "x" * 1500
    output = tmp_path / "long.safetensors"
    arguments = ["capture", "-o", str(output), "-m", str(directory), "-p", prompt]
    result = runner.invoke(app, arguments)
    assert result.exit_code == 2 and not output.exists()
    message = " ".join(result.stderr.split())
    assert "1501 tokens is longer than the 512 positions" in message and "--force" in message
    forced = runner.invoke(app, [*arguments, "--force"])
    assert forced.exit_code == 0, forced.stderr
    assert "warning:" in forced.stderr and "512 positions" in forced.stderr
    with Snapshot.open(output) as snap:
        assert len(snap.sequences[0].token_ids) == 1501
    # The library refuses it too, unless forced.
    loaded = load_model(str(directory))
    with pytest.raises(ValueError, match="longer than the model's 512 positions"):
        kt.prefill_token_ids(loaded, [[1] * 600])
    assert len(kt.prefill_token_ids(loaded, [[1] * 600], force=True)[0][1]) == 600
