"""``kvsnap store list|verify|prune`` on a remote tier's URL, against moto's S3 server on
loopback (``benchmarks/s3_loopback.py``), reached the standard way (``AWS_ENDPOINT_URL_S3`` and
credentials in the environment).

A node of the connector (``tests/support/remote_nodes.py``) uploads real chunks; objects are
planted beside them: one unsigned, one signed with the key the older way (pages bound by
xxh3-64 only). ``list`` shows every chunk, ``verify`` with the key names those two and nothing
else, and ``prune`` deletes chunks least recently used first, where a fetch by another node
counts as a use.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("moto.server", reason="moto[server] (the test extra) is not installed")
pytest.importorskip("s3fs", reason="s3fs (the s3 extra) is not installed")

from typer.testing import CliRunner

from benchmarks.s3_loopback import LoopbackS3
from kvsnap.cli.app import app
from kvsnap.store.files.keys import load_key_ring, new_key_text
from tests.support.remote_nodes import chunk_keys, local_chunk, make_node, prompts, serve
from tests.support.signed_v1 import rewrite_as_v1_signed

runner = CliRunner()


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[LoopbackS3]:
    server = LoopbackS3("kvsnap-cli-remote")
    for name, value in server.client_environment().items():
        monkeypatch.setenv(name, value)
    try:
        yield server
    finally:
        server.stop()


def _invoke(*arguments: str) -> tuple[int, dict]:
    result = runner.invoke(app, ["store", *arguments, "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_list_verify_and_prune_a_remote_tier(s3: LoopbackS3, tmp_path: Path) -> None:
    key_file = tmp_path / "store.key"
    key_file.write_text(new_key_text())
    key_file.chmod(0o600)
    keys = load_key_ring([str(key_file)])
    url = f"s3://{s3.bucket}/tier"
    uploaded, older, unsigned = prompts(11, 3)
    a = make_node(tmp_path / "a", keys, url)
    serve(a, uploaded, "a0")
    a.wait_for_uploads()
    a.worker.shutdown()
    fs = s3.filesystem()
    planted = {}
    for name, target, signer in (("older", older, keys), ("unsigned", unsigned, None)):
        writer = make_node(tmp_path / f"writer-{name}", signer)
        serve(writer, target, "w0")
        chunk = local_chunk(writer, chunk_keys(target)[0])
        if name == "older":
            rewrite_as_v1_signed(chunk, keys)
        remote_path = local_chunk(a, chunk_keys(target)[0]).relative_to(tmp_path / "a")
        fs.pipe_file(f"{s3.bucket}/tier/{remote_path}", chunk.read_bytes())
        planted[name] = str(remote_path)

    code, listed = _invoke("list", url)
    assert code == 0
    chunks = {row["path"]: row for row in listed["entries"] if row["kind"] == "chunk"}
    expected = {
        str(local_chunk(a, key).relative_to(tmp_path / "a")) for key in chunk_keys(uploaded)
    }
    assert set(chunks) == expected | set(planted.values())
    assert listed["bytes"] == sum(row["bytes"] for row in listed["entries"])
    # The table: the listing reads no object, so it has no encoding column (a local one has).
    table = runner.invoke(app, ["store", "list", url])
    assert table.exit_code == 0 and "last used" in table.stdout
    assert "encoding" not in table.stdout and len(chunks) <= table.stdout.count(" ago ")

    code, verified = _invoke("verify", url, "--key-file", str(key_file))
    assert code == 1 and verified["checked"] == len(chunks)
    states = {row["path"]: row["state"] for row in verified["entries"]}
    assert states[planted["older"]] == "weak signature"
    assert states[planted["unsigned"]] == "unsigned"
    assert {states[path] for path in expected} == {"ok"}

    # Node B's fetches record a use of the uploaded prompt's chunks, later than every write:
    # without that record they are the oldest, and would go first.
    time.sleep(1.1)  # S3's modification times are whole seconds
    b = make_node(tmp_path / "b", keys, url)
    b_counts = serve(b, uploaded, "b0")
    b.scheduler.remote.wait_for_records()
    b.worker.shutdown()
    assert b_counts["loaded_blocks"] > 0 and b_counts["wrong_kv"] == 0
    kept = expected
    bound = sum(chunks[path]["bytes"] for path in kept)
    code, pruned = _invoke("prune", url, "--max-bytes", str(bound))
    assert code == 0 and pruned["fits"]
    removed = {row["path"] for row in pruned["removed"] if row["kind"] == "chunk"}
    assert removed == set(planted.values())
    code, listed = _invoke("list", url)
    assert {row["path"] for row in listed["entries"] if row["kind"] == "chunk"} == kept
