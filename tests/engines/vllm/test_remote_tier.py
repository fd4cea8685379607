"""The remote tier under the connector, against a real S3-protocol server on loopback.

moto's server runs in this process on 127.0.0.1 (``benchmarks/s3_loopback.py``); the nodes
reach it through a fault-injecting proxy, the standard way (``AWS_ENDPOINT_URL_S3`` and
credentials in the environment). A node is the connector's scheduler and worker without vLLM
on a local store of its own (``tests/support/remote_nodes.py``), every loaded block compared
bit-exact with the prompt's reference KV. Each test has a prefix of the bucket to itself.

* One node's saves, uploaded, load bit-exact on another node with an empty store: one ``GET``
  per chunk, checked and published into its local store.
* While a fetch is in flight the scheduler answers vLLM "not yet" before the remote answers.
* Each kind of remote failure (slow past the deadline, a timeout, 500, 503 ``SlowDown``, 403,
  a body cut short, a dropped connection, the server down) is a miss: the prompt computed, no
  failed load, the failure counted under its kind and said once; the kinds that say the
  remote is down pause it (the next request sends nothing), and it is asked again later.
* An object planted under a chunk's name (unsigned, signed with another key, another prompt's
  chunk, garbage) is never served and never enters the local store.
* An upload never replaces an object, and a name already taken counts as done; a failed
  upload leaves nothing; the bytes queued are bounded; on a shared filesystem a writer killed
  mid-upload leaves no chunk.
* The engine starts with the remote unreachable, says so, and serves from its local store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsnap.engines.vllm import ConnectorOptions, count_events, remote_health
from kvsnap.engines.vllm.remote_store import RemoteStore
from kvsnap.engines.vllm.remote_tier import check_remote_options
from kvsnap.format.signing import KeyRing
from kvsnap.store.keys import load_key_ring, new_key_text
from tests.support.remote_nodes import (
    chunk_keys,
    loadable_blocks,
    local_chunk,
    make_node,
    object_name,
    prompts,
    serve,
)
from tests.support.signed_v1 import rewrite_as_v1_signed

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

from benchmarks.s3_loopback import Fault, FaultProxy, LoopbackS3

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def s3() -> Iterator[LoopbackS3]:
    server = LoopbackS3("kvsnap-remote-tier")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def proxy(s3: LoopbackS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    front = FaultProxy(s3.port)
    for name, value in s3.client_environment(front.endpoint).items():
        monkeypatch.setenv(name, value)
    try:
        yield front
    finally:
        front.stop()


def _key_ring(directory: Path) -> KeyRing:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "key"
    path.write_text(new_key_text())
    path.chmod(0o600)
    return load_key_ring([str(path)])


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> KeyRing:
    return _key_ring(tmp_path_factory.mktemp("key"))


def _prefix(request: pytest.FixtureRequest) -> str:
    """A prefix of the bucket for this test alone."""
    return str(request.node.name).replace("[", "-").replace("]", "").replace("/", "-")


def _url(s3: LoopbackS3, request: pytest.FixtureRequest) -> str:
    """The URL of the remote tier at :func:`_prefix` of the bucket."""
    return f"s3://{s3.bucket}/{_prefix(request)}"


def _stored_by_one_node(tmp_path: Path, keys: KeyRing, url: str, batch: list[np.ndarray]) -> None:
    """Node A computes and saves ``batch``; its uploads are done."""
    node = make_node(tmp_path / "a", keys, url)
    for index, prompt in enumerate(batch):
        counts = serve(node, prompt, f"a{index}")
        assert counts["loaded_blocks"] == 0 and counts["saves"] > 0
    node.wait_for_uploads()
    node.worker.shutdown()
    uploads = node.events.named("upload")
    assert len(uploads) == sum(len(chunk_keys(prompt)) for prompt in batch)
    assert all(upload["created"] for upload in uploads)


def test_a_chunk_saved_on_one_node_loads_bit_exact_on_another(
    s3: LoopbackS3, proxy: FaultProxy, keys: KeyRing, tmp_path: Path, request: Any
) -> None:
    url = _url(s3, request)
    (prompt,) = prompts(1, 1)
    _stored_by_one_node(tmp_path, keys, url, [prompt])
    proxy.requests.clear()
    b = make_node(tmp_path / "b", keys, url)
    counts = serve(b, prompt, "b0")
    # Every loadable block came from the bucket, through B's local store, bit-exact.
    assert counts["loaded_blocks"] == loadable_blocks(prompt) and counts["wrong_kv"] == 0
    assert counts["failed_loads"] == 0 and counts["saves"] == 0
    keys_of = chunk_keys(prompt)
    assert all(local_chunk(b, key).is_file() for key in keys_of)
    # One GET per chunk; one PUT each, queued after it, records the fetch for the LRU.
    b.scheduler.remote.wait_for_records()
    assert proxy.requests == {"GET": len(keys_of), "PUT": len(keys_of)}
    assert len(b.scheduler_events.named("fetch")) == len(keys_of)
    (lookup,) = b.scheduler_events.named("remote_lookup")
    assert lookup["outcome"] == "hit" and lookup["chunks"] == len(keys_of)
    (hit,) = b.scheduler_events.named("hit")
    assert hit["remote_tokens"] == hit["tokens"] == loadable_blocks(prompt) * 16
    # The next request for it is a local hit: no request to the remote at all.
    proxy.requests.clear()
    again = serve(b, prompt, "b1")
    assert again["loaded_blocks"] == loadable_blocks(prompt) and proxy.requests == {}


def test_the_scheduler_answers_not_yet_before_the_remote_answers(
    s3: LoopbackS3, proxy: FaultProxy, keys: KeyRing, tmp_path: Path, request: Any
) -> None:
    url = _url(s3, request)
    (prompt,) = prompts(2, 1)
    _stored_by_one_node(tmp_path, keys, url, [prompt])
    b = make_node(tmp_path / "b", keys, url)
    proxy.set_faults(Fault(method="GET", delay_s=0.5))
    answered = proxy.answered
    from types import SimpleNamespace

    query = SimpleNamespace(
        request_id="q",
        prompt_token_ids=prompt.tolist(),
        sampling_params=SimpleNamespace(extra_args=None),
        all_token_ids=prompt.tolist(),
    )
    first, asynchronous = b.scheduler.get_num_new_matched_tokens(query, 0)
    # "Not yet", given before the server answered anything (the fetches are held 0.5 s).
    assert first is None and not asynchronous and proxy.answered == answered
    assert b.matched(query) == loadable_blocks(prompt) * 16


_FAILURES = {
    # name: (proxy rules, the kind counted, whether it pauses the remote, extra options)
    "slow": ([Fault(method="GET", delay_s=1.5)], "deadline", True, {"remote_deadline_s": 0.3}),
    "timeout": (
        [Fault(method="GET", delay_s=1.5)],
        "timeout",
        True,
        {"remote_options": {"config_kwargs": {"read_timeout": 0.3}}},
    ),
    "500": ([Fault(method="GET", status=500)], "server_error", True, {}),
    "503": ([Fault(method="GET", status=503, code="SlowDown")], "throttled", True, {}),
    "403": ([Fault(method="GET", status=403, code="AccessDenied")], "forbidden", False, {}),
    "truncated": ([Fault(method="GET", truncate=True)], "truncated", False, {}),
    "dropped": ([Fault(method="GET", drop=True)], "unreachable", True, {}),
    "down": (None, "unreachable", True, {}),
}


@pytest.mark.parametrize("failure", list(_FAILURES))
def test_each_remote_failure_is_a_miss_counted_and_said_once(
    s3: LoopbackS3,
    proxy: FaultProxy,
    keys: KeyRing,
    tmp_path: Path,
    request: Any,
    failure: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rules, kind, pauses, options = _FAILURES[failure]
    # A pause long enough to outlast this test however loaded the machine is.
    monkeypatch.setattr(remote_health, "RETRY_FIRST_S", 600.0)
    url = _url(s3, request)
    batch = prompts(3, 2)
    _stored_by_one_node(tmp_path, keys, url, batch)
    b = make_node(tmp_path / "b", keys, url, **options)
    if rules is None:
        proxy.stop()
    else:
        proxy.set_faults(*rules)
    first = serve(b, batch[0], "b0")
    # A miss: computed (nothing loaded, no failed load), saved in B's own store.
    assert first["loaded_blocks"] == 0 and first["failed_loads"] == 0 and first["wrong_kv"] == 0
    assert first["saves"] == len(chunk_keys(batch[0]))
    health = b.scheduler.remote.health
    assert health.counts.get(kind, 0) >= 1, health.counts
    # The first lookup's other fetches began alongside the one that failed: let them end.
    b.scheduler.remote.wait_for_fetches()
    sent = dict(proxy.requests)
    second = serve(b, batch[1], "b1")
    assert second["loaded_blocks"] == 0 and second["failed_loads"] == 0
    outcomes = [event["outcome"] for event in b.scheduler_events.named("remote_lookup")]
    if pauses:
        # Left alone for a while: the second request's lookup sent nothing and waited for
        # nothing (the PUTs are B's worker uploading its saves, a health of its own).
        assert outcomes[1] == "paused" and proxy.requests.get("GET") == sent.get("GET")
    else:
        assert health.counts[kind] >= 2
    said = [event for event in b.scheduler_events.named("remote_failure") if event["kind"] == kind]
    assert len(said) == 1, said


def test_the_remote_is_asked_again_once_it_is_back(
    s3: LoopbackS3, proxy: FaultProxy, keys: KeyRing, tmp_path: Path, request: Any
) -> None:
    url = _url(s3, request)
    batch = prompts(4, 2)
    _stored_by_one_node(tmp_path, keys, url, batch)
    b = make_node(tmp_path / "b", keys, url)
    proxy.set_faults(Fault(method="GET", status=500))
    assert serve(b, batch[0], "b0")["loaded_blocks"] == 0
    proxy.set_faults()
    time.sleep(1.1)  # the first pause (RETRY_FIRST_S) is over
    counts = serve(b, batch[1], "b1")
    assert counts["loaded_blocks"] == loadable_blocks(batch[1]) and counts["wrong_kv"] == 0
    assert count_events(b.scheduler_events.records, "remote_available") == 1


def _plant(s3: LoopbackS3, prefix: str, key: str, data: bytes) -> None:
    s3.filesystem().pipe_file(object_name(s3.bucket, prefix, key), data)


def test_a_planted_object_is_never_served_nor_stored(
    s3: LoopbackS3, proxy: FaultProxy, keys: KeyRing, tmp_path: Path, request: Any
) -> None:
    prefix, url = _prefix(request), _url(s3, request)
    kinds = ("unsigned", "another key", "older signature", "another chunk", "garbage")
    targets = prompts(5, len(kinds) + 1)
    donor = targets.pop()
    signers = {
        "unsigned": None,
        "another key": _key_ring(tmp_path / "other"),
        "older signature": keys,  # this key, pages bound by xxh3-64 only (hmac-sha256)
        "another chunk": keys,
    }
    planted = {}
    for kind, target in zip(kinds, targets, strict=True):
        if kind == "garbage":
            data = os.urandom(4096)
        else:  # a real chunk of the target (or of the donor prompt), from a local store
            writer = make_node(tmp_path / f"writer-{len(planted)}", signers[kind])
            source = donor if kind == "another chunk" else target
            serve(writer, source, "w0")
            chunk = local_chunk(writer, chunk_keys(source)[0])
            if kind == "older signature":
                rewrite_as_v1_signed(chunk, keys)
            data = chunk.read_bytes()
        planted[kind] = data
        _plant(s3, prefix, chunk_keys(target)[0], data)
    b = make_node(tmp_path / "b", keys, url)
    for kind, target in zip(kinds, targets, strict=True):
        counts = serve(b, target, kind)
        assert counts["loaded_blocks"] == 0 and counts["wrong_kv"] == 0, kind
        assert counts["failed_loads"] == 0, kind
        # Refused before it reached the local store: the chunk there now is B's own.
        assert local_chunk(b, chunk_keys(target)[0]).read_bytes() != planted[kind], kind
    assert b.scheduler.remote.health.counts.get("invalid") == len(kinds)
    reasons = [event["error"] for event in b.scheduler_events.named("remote_failure")]
    assert len(reasons) == 1  # said once
    assert not list((tmp_path / "b").rglob("quarantine/*"))  # never matched from the store


def test_an_upload_never_replaces_an_object_and_a_taken_name_is_done(
    s3: LoopbackS3, proxy: FaultProxy, keys: KeyRing, tmp_path: Path, request: Any
) -> None:
    prefix, url = _prefix(request), _url(s3, request)
    (target,) = prompts(6, 1)
    first = chunk_keys(target)[0]
    occupant = os.urandom(1000)  # anything already there: never replaced by an upload
    _plant(s3, prefix, first, occupant)
    a = make_node(tmp_path / "a", keys, url)
    serve(a, target, "a0")  # the planted object is a miss (invalid); A computes and saves
    a.wait_for_uploads()
    uploads = {event["path"]: event["created"] for event in a.events.named("upload")}
    assert uploads[str(local_chunk(a, first))] is False
    assert all(uploads[str(local_chunk(a, key))] for key in chunk_keys(target)[1:])
    fs = s3.filesystem()
    assert fs.cat_file(object_name(s3.bucket, prefix, first)) == occupant


def test_a_failed_upload_leaves_nothing_and_the_bytes_queued_are_bounded(
    s3: LoopbackS3, proxy: FaultProxy, keys: KeyRing, tmp_path: Path, request: Any
) -> None:
    prefix, url = _prefix(request), _url(s3, request)
    dropped, bounded = prompts(7, 2)
    a = make_node(tmp_path / "a", keys, url)
    proxy.set_faults(Fault(method="PUT", path="/chunks/", drop=True))
    serve(a, dropped, "a0")
    a.wait_for_uploads()
    assert a.events.named("upload") == []
    assert a.worker._saves.uploader.health.counts.get("unreachable", 0) >= 1
    fs = s3.filesystem()
    assert not fs.exists(f"{s3.bucket}/{prefix}/soak/chunks")
    assert not fs.call_s3("list_multipart_uploads", Bucket=s3.bucket).get("Uploads")
    # A bound below one chunk: nothing is queued, nothing sent, the chunks stay local.
    proxy.set_faults()
    small = make_node(tmp_path / "c", keys, url, remote_max_upload_bytes=1000)
    serve(small, bounded, "c0")
    small.wait_for_uploads()
    skipped = small.events.named("upload_skipped")
    assert len(skipped) == len(chunk_keys(bounded)) and small.events.named("upload") == []
    assert all(local_chunk(small, key).is_file() for key in chunk_keys(bounded))


def test_the_engine_starts_with_the_remote_unreachable_and_says_so(
    s3: LoopbackS3, proxy: FaultProxy, keys: KeyRing, tmp_path: Path, request: Any
) -> None:
    url = _url(s3, request)
    proxy.stop()
    (prompt,) = prompts(8, 1)
    node = make_node(tmp_path / "a", keys, url)
    node.scheduler.remote.probe().result(timeout=30)
    (said,) = node.scheduler_events.named("remote_unreachable")
    assert said["kind"] == "unreachable"
    assert serve(node, prompt, "a0")["saves"] == len(chunk_keys(prompt))
    again = serve(node, prompt, "a1")  # its own store serves it
    assert again["loaded_blocks"] == loadable_blocks(prompt) and again["wrong_kv"] == 0


def test_the_options_refuse_a_remote_tier_without_a_key(tmp_path: Path) -> None:
    options = ConnectorOptions.from_extra_config(
        {"path": str(tmp_path), "remote_url": "s3://bucket/prefix"}
    )
    with pytest.raises(ValueError, match="needs a signing key"):
        check_remote_options(options, None)
    with pytest.raises(ValueError, match="remote_mode"):
        ConnectorOptions.from_extra_config(
            {"path": str(tmp_path), "remote_url": "s3://b/p", "remote_mode": "write"}
        )
    with pytest.raises(ValueError, match="need remote_url"):
        ConnectorOptions.from_extra_config({"path": str(tmp_path), "remote_fetches": 2})
    read_only = ConnectorOptions.from_extra_config(
        {"path": str(tmp_path), "remote_url": "s3://b/p", "remote_mode": "read"}
    )
    assert not read_only.remote_writes


_KILLED_WRITER = """
import os, sys
from kvsnap.engines.vllm import remote_health
from kvsnap.engines.vllm.remote_store import RemoteStore
from tests.support.slow_fsync import slow_down_fsync
slow_down_fsync(60.0, sys.argv[2])
store = RemoteStore(sys.argv[1], "ns")
print("writing", flush=True)
store.create("ab" * 32, os.urandom(1 << 20))
"""


def test_a_writer_killed_mid_upload_to_a_shared_filesystem_leaves_no_chunk(
    tmp_path: Path,
) -> None:
    tier = tmp_path / "tier"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, f"file://{tier}", str(tier)],
        stdout=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == b"writing"
    chunk = tier / "ns" / "chunks" / "ab" / f"{'ab' * 32}.safetensors"
    deadline = time.monotonic() + 30
    while not list(chunk.parent.glob(".*")) and time.monotonic() < deadline:
        time.sleep(0.01)  # its temporary file exists: the write is under way
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not chunk.exists()
    leftovers = list(chunk.parent.glob(".*kvsnap-tmp-*"))
    assert len(leftovers) == 1
    # A complete write of the same name afterwards works, and the name is then taken.
    store = RemoteStore(f"file://{tier}", "ns")
    assert store.create("ab" * 32, b"whole") and not store.create("ab" * 32, b"other")
    assert chunk.read_bytes() == b"whole"
