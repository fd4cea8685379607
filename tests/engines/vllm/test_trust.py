"""A store engines can trust, against real vLLM (CPU): identity, weights, signing, permissions.

Every engine runs in a subprocess with ``.venv-vllm``'s Python
(``tests/support/vllm_engines.py``), once per session, in the world that
``tests/support/vllm_trust.py`` builds beside the other modules' (``vllm_worlds.py``); the
module skips without ``.venv-vllm``. One random-weight Llama, two LoRA adapters on its key and
value projections, a signing key, and one store (chunks of 2 blocks of 32 tokens):

* R, no connector (LoRA on), in one process (the ``uni`` executor): every prompt's reference
  tokens.
* S, signing: stores X under adapter ``a``, W under ``cache_salt`` ``s1``, P plainly and Q.
  Then Q's chunk is replaced by the same KV written without the key (valid checksums).
* T, a restart, signing: X under ``a`` hits; X under ``b`` and without an adapter miss; W
  under ``s1`` hits, under ``s2`` and without a salt misses; P hits; the planted Q is never
  served. Every output equals R's.
* U, a fine-tune of the model (one weight tensor scaled) on the same store: P misses.
* V, the store made writable by every user: the engine refuses to start.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvsnap.engines.vllm import read_events
from kvsnap.snapshot import Snapshot
from tests.support.vllm_trust import BLOCK, Trust

pytestmark = pytest.mark.vllm


def _chunks(store: Path) -> list[Path]:
    return sorted(store.glob("*/chunks/*/*.safetensors"))


def test_every_output_equals_the_plain_engines(trust: Trust) -> None:
    reference = trust.runs["r"].tokens
    for run in ("s", "t"):
        for label, tokens in trust.runs[run].tokens.items():
            assert tokens == reference[label], (run, label)


def test_a_prefix_stored_under_one_adapter_misses_under_another_and_without_one(
    trust: Trust,
) -> None:
    t = trust.runs["t"]
    assert t.cached["X-a"] >= 2 * BLOCK and t.events_for("load", "X-a")
    for label in ("X-b", "X"):
        assert t.cached[label] == 0 and not t.events_for("load", label), label
    # X under b computes other KV than under a: they are different chunks, both stored now.
    saved = t.saved()
    assert saved["X-b"] and saved["X"] and not set(saved["X-b"]) & set(saved["X"])


def test_a_prefix_stored_under_one_salt_misses_under_another_and_without_one(
    trust: Trust,
) -> None:
    t = trust.runs["t"]
    assert t.cached["W-s1"] >= 2 * BLOCK and t.events_for("load", "W-s1")
    for label in ("W-s2", "W"):
        assert t.cached[label] == 0 and not t.events_for("load", label), label


def test_the_same_identity_hits_after_a_restart(trust: Trust) -> None:
    t = trust.runs["t"]
    assert [event["tokens"] for event in t.events_for("load", "P")] == [3 * BLOCK]


def test_a_planted_unsigned_chunk_is_never_served(trust: Trust) -> None:
    t = trust.runs["t"]
    assert t.cached["Q"] == 0 and not t.events_for("load", "Q")
    (miss,) = t.events_for("miss", "Q")
    assert miss["reason"].startswith("unsigned")
    (moved,) = t.events_for("quarantine", "Q")
    assert Path(moved["moved_to"]).exists() and moved["path"] == str(trust.planted)
    # The prompt was computed and stored again, signed.
    (save,) = t.events_for("save", "Q")
    with Snapshot.open(save["path"]) as snapshot:
        assert snapshot.metadata.signature == "hmac-sha256-blake3"


def test_a_fine_tune_of_the_same_architecture_misses_the_base_models_store(
    trust: Trust,
) -> None:
    u = trust.runs["u"]
    assert u.cached["P"] == 0 and not u.events_for("load", "P") and not u.events_for("hit", "P")
    namespaces = sorted(path.name for path in trust.store.iterdir() if path.is_dir())
    assert len(namespaces) == 2, namespaces  # the base model's, and the fine-tune's own
    assert u.events_for("save", "P")


def test_a_store_other_users_can_write_is_refused(trust: Trust) -> None:
    assert "is writable by other users (mode 777)" in trust.refused_log
    assert "chmod 700" in trust.refused_log
    assert not read_events(trust.tmp / "v.events.jsonl")


def test_store_files_and_directories_are_private(trust: Trust) -> None:
    assert (trust.store.stat().st_mode & 0o777) == 0o700
    for chunk in _chunks(trust.store):
        assert (chunk.stat().st_mode & 0o777) == 0o600, chunk
        assert (chunk.parent.stat().st_mode & 0o777) == 0o700, chunk.parent
    assert os.access(trust.store, os.W_OK)
