"""KVSnapConnector against real vLLM (CPU build): persist, restart, sharing, corruption, eviction.

Every engine runs in a subprocess with ``.venv-vllm/bin/python`` (``scripts/setup_vllm_venv.sh``
creates it); this file is marked ``vllm`` and skips without it. The engines share one
random-weight Llama with 2 KV heads, one store (chunks of 2 blocks of 32 tokens) and one
scenario:

* E0, TP=1, no connector, in one process (the ``uni`` executor): the reference tokens of
  every prompt (runs beside the others).
* E1, TP=1: computes A, B, C and S1..S4 (one 4-block system prompt, each its own 70-token
  question); persists A, B and the S prompts (C opts out), dumps all.
* E2, TP=2, on a slow disk (every fsync into the store waits): loads A (a TP=1 capture) into
  TP=2, computes and persists C (a TP=2 capture, gathered on rank 0), dumps both; its saves are
  still being written when it shuts down, and its shutdown finishes them.
* E3, TP=1, ``verify_before_load`` off, after B's chunk is corrupted and two forged chunks are
  added: loads A, C, the S prompts and A's first chunk for D; B's load fails its checksum in
  the worker and is recomputed; F and G are logged misses; the bad chunks are quarantined.
* E4, TP=1, vLLM's default ``kv_load_failure_policy``, after one byte of KV data is flipped in
  every chunk: every chunk fails the scheduler's check, is quarantined and recomputed.
* E5, TP=1, default policy, a capacity bound: loads the fresh chunks E4 wrote, stores H and
  evicts the quarantined chunks and the least recently used ones to fit the bound.

Every engine's tokens must equal E0's, and the dumps prove the restored cache bit-exact. The
engines run once per session (``tests/support/vllm_scenario.py``, the ``scenario`` fixture of
this folder's conftest, built beside the other modules' engines: ``vllm_worlds.py``);
``test_dumps.py`` reads their dumps with other tools.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsnap.engines.vllm import PrefixStore, count_events
from kvsnap.snapshot import Snapshot
from tests.support.vllm_scenario import (
    BLOCK,
    CHUNK_BLOCKS,
    SHARING,
    Scenario,
    _assert_same_kv,
    _dump,
    _keys,
    _kv,
    _problems,
    _tokens,
)

pytestmark = pytest.mark.vllm


def test_persisted_prompts_load_after_restart_with_the_same_tokens(scenario: Scenario) -> None:
    runs, chunks = scenario.runs, scenario.chunks
    reference, e1, e3 = runs["e0"], runs["e1"], runs["e3"]
    for label in ("A", "B", "C"):
        assert e1.tokens[label] == reference.tokens[label], label
    # E1 computed everything and persisted the loadable blocks of A and B as chunks of two
    # blocks (A's third block alone), none of C (opted out).
    assert _tokens(e1, "save", "A") == [64, 32] and _tokens(e1, "save", "B") == [64]
    # Nothing of A, B or C was stored before E1 (later requests of E1 may find chunks that
    # E1 itself stored a moment earlier, depending on the scheduler's timing).
    assert e1.events_for("save", "C") == []
    assert all(e1.events_for("hit", label) == [] for label in ("A", "B", "C"))
    # E3 started fresh and skipped the stored prefixes: A whole, D the chunk it shares with A.
    for label, skipped in (("A", 96), ("D", 64)):
        assert _tokens(e3, "hit", label) == [skipped], label
        assert _tokens(e3, "load", label) == [skipped], label
        assert e3.cached[label] == skipped, label
        assert e3.tokens[label] == reference.tokens[label], label
    assert e3.events_for("load", "D")[0]["paths"] == [str(chunks["A"][0])]
    # The restored blocks are the persisted bytes: E3's dumps start with them.
    _assert_same_kv(_dump(e3, "A"), scenario.kept["A"], 96)
    _assert_same_kv(_dump(e3, "D"), scenario.kept["A"][:1], 64)
    # A prefix already in the store is not written again; D stores only its own chunk.
    assert e3.events_for("save", "A") == [] and _tokens(e3, "save", "D") == [32]


def test_requests_sharing_a_prefix_store_it_once(scenario: Scenario) -> None:
    runs, prompts = scenario.runs, scenario.prompts
    e1, e3 = runs["e1"], runs["e3"]
    store = PrefixStore(scenario.store, scenario.namespace.name, chunk_blocks=CHUNK_BLOCKS)
    chain = _keys(prompts["S1"][: 6 * BLOCK])
    shared = [store.chunk_path(chain[1]), store.chunk_path(chain[3])]
    saved = {label: e1.saved().get(label, []) for label in SHARING}
    # Four requests behind one 4-block system prompt: its two chunks were written once, and
    # each request wrote its own last chunk only.
    written = [path for label in SHARING for path in saved[label]]
    assert sorted(written) == sorted(set(written)) and len(written) == 2 + len(SHARING)
    assert set(shared) <= set(written)
    own = {label: [path for path in saved[label] if path not in shared] for label in SHARING}
    assert all(len(paths) == 1 for paths in own.values()), own
    # Bytes on disk, measured after E1: the shared prefix once, not once per request.
    on_disk = scenario.bytes_after_e1
    shared_bytes = sum(on_disk[path] for path in shared)
    own_bytes = sum(on_disk[paths[0]] for paths in own.values())
    sharing_bytes = sum(on_disk[path] for path in written)
    assert sharing_bytes == shared_bytes + own_bytes
    assert sharing_bytes < len(SHARING) * shared_bytes  # per-request storage would need more
    a_and_b = sum(on_disk[path] for path in [*scenario.chunks["A"], *scenario.chunks["B"]])
    assert sum(on_disk.values()) == sharing_bytes + a_and_b
    # After a restart every one of them loads the shared chunks, then its own.
    for label in SHARING:
        (load,) = e3.events_for("load", label)
        assert load["paths"] == [str(path) for path in [*shared, *own[label]]], label
        assert load["tokens"] == 6 * BLOCK and e3.cached[label] == 6 * BLOCK
        assert e3.tokens[label] == runs["e0"].tokens[label] == e1.tokens[label], label


def test_corrupt_chunk_found_while_loading_is_reported_and_recomputed(
    scenario: Scenario,
) -> None:
    e1, e3, tensor_name = scenario.runs["e1"], scenario.runs["e3"], scenario.corrupted[0]
    chunk = str(scenario.chunks["B"][0])
    # E3 does not verify before loading: the header is intact, so the scheduler matched and
    # the worker's checksum check refused the chunk.
    assert _tokens(e3, "hit", "B") == [64] and e3.events_for("load", "B") == []
    (failure,) = e3.events_for("load_failed", "B")
    # The warm pipeline writes every page that passed and names the ones that did not.
    assert "RestoreIncompleteError" in failure["error"], failure
    assert "failed their checksum" in failure["error"] and tensor_name in failure["error"]
    assert failure["path"] == chunk
    (moved,) = e3.events_for("quarantine", "B")
    assert moved["role"] == "worker" and moved["path"] == chunk
    assert scenario.quarantine_problems[moved["moved_to"]] > 0  # still the damaged file
    assert e3.tokens["B"] == scenario.runs["e0"].tokens["B"]
    # The recomputed KV is the KV E1 computed (same engine, same kernel): not the corrupt bytes.
    _assert_same_kv(_dump(e3, "B"), _dump(e1, "B"), 80)
    # Once recomputed, B is persisted again, a fresh chunk in place of the quarantined one.
    (save,) = e3.events_for("save", "B")
    assert save["path"] == chunk and save["tokens"] == 64


def test_mismatching_chunks_are_logged_misses_and_quarantined(scenario: Scenario) -> None:
    e3, reference = scenario.runs["e3"], scenario.runs["e0"]
    (forged_copy,) = e3.events_for("miss", "F")
    assert "is not this prompt's prefix" in forged_copy["reason"]
    (other_model,) = e3.events_for("miss", "G")
    assert "model fingerprint ffffffffffffffff differs" in other_model["reason"]
    for label, miss in (("F", forged_copy), ("G", other_model)):
        (moved,) = e3.events_for("quarantine", label)
        assert moved["path"] == miss["path"] and moved["moved_to"] in scenario.quarantine_problems
        assert _tokens(e3, "save", label) == [64]  # computed, then stored as a fresh chunk
        assert e3.events_for("load", label) == [] and e3.cached[label] == 0
        assert e3.tokens[label] == reference.tokens[label], label


def test_tp2_capture_restores_at_tp1_and_tp1_capture_at_tp2(scenario: Scenario) -> None:
    runs, kept = scenario.runs, scenario.kept
    e1, e2, e3, reference = runs["e1"], runs["e2"], runs["e3"], runs["e0"]
    # TP=1 capture (E1) into TP=2 (E2): both ranks load their own heads of the same blocks.
    loads = e2.events_for("load", "A")
    assert sorted(e["rank"] for e in loads) == [0, 1] and {e["tokens"] for e in loads} == {96}
    assert e2.tokens["A"] == reference.tokens["A"] and e2.cached["A"] == 96
    _assert_same_kv(_dump(e2, "A"), kept["A"], 96)
    # TP=2 capture (E2, gathered on rank 0 and written once per chunk) into TP=1 (E3).
    saves = e2.events_for("save", "C")
    assert [(e["rank"], e["tokens"]) for e in saves] == [(0, 64), (0, 64)]
    # E2 wrote to a slow disk: both workers' shutdowns finished every save, none abandoned.
    shutdowns = [event for event in e2.events if event["event"] == "shutdown"]
    assert sorted(e["rank"] for e in shutdowns) == [0, 1]
    assert all(e["abandoned"] == 0 for e in shutdowns), shutdowns
    for path in kept["C"]:
        with Snapshot.open(path) as snap:
            assert snap.metadata.tp_size == 2 and snap.geometry.num_kv_heads == 2
            assert snap.verify() == []
    _assert_same_kv(_dump(e2, "C"), kept["C"], 128)
    assert _tokens(e3, "load", "C") == [128]
    assert e3.tokens["C"] == reference.tokens["C"] and e2.tokens["C"] == reference.tokens["C"]
    _assert_same_kv(_dump(e3, "C"), kept["C"], 128)
    # The TP=2 chunks hold the TP=1 KV (E1's dump of C) up to the bf16 rounding of TP's
    # all-reduce in layer 1: two bf16 steps at the values' scale (|KV| < 16, one step 0.0625
    # there). Heads in the wrong place would differ by the values' own size (~10).
    tp2, tp1 = _kv(kept["C"], 128), _kv(_dump(e1, "C"), 128)
    for name, values in tp2.items():
        assert (values.float() - tp1[name].float()).abs().max() <= 0.125, name
        assert values.float().abs().max() < 16, name


def test_corrupted_store_under_default_policy_costs_a_recompute_never_a_request(
    scenario: Scenario,
) -> None:
    e4, reference = scenario.runs["e4"], scenario.runs["e0"]
    assert (
        json.loads((scenario.store.parent / "e4.job.json").read_text())["load_failure_policy"]
        is None
    )
    for label, tokens in e4.tokens.items():
        assert len(tokens) == 8 and tokens == reference.tokens[label], label
    # Nothing was served from a damaged chunk: no load failed, and the only loads (of prompts
    # scheduled after another had recomputed and stored their prefix again) read chunks this
    # engine wrote itself, after it had written them.
    assert count_events(e4.events, "load_failed") == 0
    written = {event["path"]: event["time"] for event in e4.events if event["event"] == "save"}
    for label in e4.tokens:
        loads = e4.events_for("load", label)
        assert e4.cached[label] == sum(load["tokens"] for load in loads), label
        for load in loads:
            assert all(written.get(path, load["time"]) < load["time"] for path in load["paths"])
    misses = [event for event in e4.events if event["event"] == "miss"]
    assert misses and all("failed verification" in event["reason"] for event in misses)
    # Every damaged chunk was quarantined (matched ones at the match, the others when their
    # prompt was persisted again), and each quarantined file still fails verification.
    moved = {
        event["path"]: event["moved_to"] for event in e4.events if event["event"] == "quarantine"
    }
    assert sorted(moved) == sorted(map(str, scenario.flipped))
    assert all(scenario.quarantine_problems[target] > 0 for target in moved.values())
    # Once recomputed, every prompt was persisted again: fresh chunks at the same names.
    resaved = {event["path"] for event in e4.events if event["event"] == "save"}
    assert resaved == set(moved)


def test_second_restart_loads_fresh_chunks_and_evicts_at_the_capacity_bound(
    scenario: Scenario,
) -> None:
    e5, reference = scenario.runs["e5"], scenario.runs["e0"]
    for name in ("miss", "quarantine", "load_failed"):
        assert count_events(e5.events, name) == 0, name
    for label, tokens in (("A", 96), ("S1", 192), ("S2", 192)):
        assert _tokens(e5, "load", label) == [tokens] and e5.cached[label] == tokens, label
    for label in e5.tokens:
        assert e5.tokens[label] == reference.tokens[label], label
    loaded = {path for event in e5.events if event["event"] == "load" for path in event["paths"]}
    for path in loaded:  # the chunks E4 wrote, never a quarantined file
        assert Path(path).exists() and _problems(Path(path)) == 0, path
        assert "quarantine" not in path
    # H's chunks pushed the store over its bound: the quarantined files went first, then the
    # least recently used chunks; none that E5 used.
    evicted = [event for event in e5.events if event["event"] == "evict"]
    quarantined = {event["path"] for event in evicted if event["quarantined"]}
    assert quarantined == set(scenario.quarantine_problems)
    chunks = {event["path"] for event in evicted if not event["quarantined"]}
    assert chunks and not chunks & loaded
    assert not chunks & {str(path) for path in e5.saved()["H"]}
    assert scenario.bytes_after_e5 <= scenario.capacity
    assert len(e5.saved()["H"]) == 2
