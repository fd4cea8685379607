"""``kvsnap store list`` for people at 80 columns: each namespace (a long model fingerprint) is
named once above its entries, which show paths relative to it; a directory of plain snapshots
gets a hint instead of a bare "0 entries"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from kvsnap.cli.app import app
from kvsnap.engines.vllm import CacheIdentity, PrefixStore, store_key_chain

REPO = Path(__file__).resolve().parents[2]
#: What a real namespace looks like: the model fingerprint, the KV dtype, the block size, the
#: KV geometry's digest.
NAMESPACE = "03a56889058c2d76-bfloat16-b16-g1fffbbac"


runner = CliRunner()


def kvsnap(*arguments: str) -> subprocess.CompletedProcess[str]:
    """``kvsnap ARGUMENTS`` as a child process on an 80-column terminal's width."""
    return subprocess.run(
        [sys.executable, "-m", "kvsnap.cli", *arguments],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="80"),
        check=False,
    )


def test_store_list_names_each_namespace_once_and_entries_relative_to_it(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, NAMESPACE)
    chain = store_key_chain(list(range(48)), 16, CacheIdentity())
    chunks = [store.chunk_path(chain[index]) for index in (0, 2)]
    for seed, chunk in enumerate(chunks):
        chunk.parent.mkdir(parents=True, exist_ok=True)
        written = runner.invoke(
            app, ["fixture", str(chunk), "--lengths", "16", "--seed", str(seed)]
        )
        assert written.exit_code == 0, written.output

    listing = kvsnap("store", "list", str(tmp_path))
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.count(NAMESPACE) == 1, listing.stdout
    for chunk in chunks:
        # Each entry's key on one line, shortened as a git hash is: nothing of it folded away.
        shown = chunk.name.removesuffix(".safetensors")[:16] + "…"
        assert any(shown in line for line in listing.stdout.splitlines()), listing.stdout
    # Below the first line (the directory as given) everything fits 80 columns.
    assert max(len(line.rstrip()) for line in listing.stdout.splitlines()[1:]) <= 80


def test_store_list_of_plain_snapshots_says_what_they_are(tmp_path: Path) -> None:
    for name in ("a.safetensors", "b.safetensors"):
        assert (
            runner.invoke(app, ["fixture", str(tmp_path / name), "--lengths", "8"]).exit_code == 0
        )
    listing = kvsnap("store", "list", str(tmp_path))
    assert listing.returncode == 0, listing.stderr
    assert "0 entries" in listing.stdout
    assert "holds 2 plain snapshot file(s) (a.safetensors, b.safetensors)" in listing.stdout
    assert "kvsnap inspect FILE" in listing.stdout
