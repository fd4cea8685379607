"""A store tampered with under live engines, against real vLLM (CPU): never wrong KV, never a
failed request.

Every engine runs in a subprocess with ``.venv-vllm``'s Python (``tests/support/
vllm_engines.py``), once per session, in the world that ``tests/support/vllm_tampered.py``
builds beside the other modules' (``vllm_worlds.py``); the module skips without ``.venv-vllm``.
One random-weight Llama, a signing key, one store (chunks of 2 blocks of 32 tokens), three
prompts P, Q and R:

* S stores P, Q and R (its store starts empty: its outputs are a plain engine's).
* T, its worker in a process of its own (vLLM's ``mp`` executor at TP 1; policy
  ``recompute``), requests P; between the scheduler's check of P's first chunk and the
  worker's load, Q's first chunk is renamed over it (``vllm_tampering_connector.py``). The
  worker finds another chunk than the one checked: a miss, recomputed; P's output is S's.
* U, vLLM's default policy (``kv_load_failure_policy`` left at ``fail``) and its worker in the
  scheduler's process (the ``uni`` executor, vLLM's default at TP 1 on a GPU), requests
  P, P again and Q, one at a time. After the first P, a byte of P's first chunk is flipped in
  place and its modification time put back (bit rot after the chunk's first check): the
  second P is a miss, recomputed, not a failed request. Between the check of Q's chunk and its
  load, R's chunk is renamed over it: the worker loads the chunk as it was checked (the
  scheduler hands it over open and read whole), a hit with Q's own KV.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_tampered import BLOCK, Tampered

pytestmark = pytest.mark.vllm


def test_a_chunk_swapped_before_a_worker_in_its_own_process_loads_it_is_a_miss(
    tampered: Tampered,
) -> None:
    s, t = tampered.runs["s"], tampered.runs["t"]
    assert t.tokens["P"] == s.tokens["P"]
    (hit,) = t.events_for("hit", "P")
    assert hit["tokens"] == 3 * BLOCK  # the scheduler checked P's chunks and offered them
    misses = [event for event in t.events_for("miss", "P") if event["role"] == "worker"]
    assert len(misses) == 1 and "not the" in misses[0]["reason"]
    assert not t.events_for("load", "P")
    assert t.finished["P"] == "length"


def test_under_vllms_defaults_a_rotted_chunk_is_recomputed_and_a_swapped_one_loads_as_checked(
    tampered: Tampered,
) -> None:
    s, u = tampered.runs["s"], tampered.runs["u"]
    for label, reference in (("P", "P"), ("P-again", "P"), ("Q", "Q")):
        assert u.tokens[label] == s.tokens[reference], label
        assert u.finished[label] == "length", label  # not an error: no failed request
    assert u.cached["P"] >= 3 * BLOCK and u.events_for("load", "P")
    # The second P: the rotted chunk failed the scheduler's verification, a miss.
    (miss,) = u.events_for("miss", "P-again")
    assert "failed verification" in miss["reason"] and miss["role"] == "scheduler"
    assert u.cached["P-again"] == 0 and not u.events_for("load_failed", "P-again")
    # Q: R's chunk was renamed over Q's after the check; Q's own KV loaded all the same.
    assert u.cached["Q"] >= 2 * BLOCK and u.events_for("load", "Q")
    assert not u.events_for("miss", "Q")
