"""A store engines can trust, against real vLLM (CPU): identity, weights, signing, permissions.

Every engine runs in a subprocess with ``.venv-vllm``'s Python
(``tests/support/vllm_engines.py``); the module skips without it. One random-weight Llama, two
LoRA adapters on its key and value projections, a signing key, and one store (chunks of 2 blocks
of 32 tokens):

* R, no connector (LoRA on): every prompt's reference tokens.
* S, signing: stores X under adapter ``a``, W under ``cache_salt`` ``s1``, P plainly and Q.
  Then Q's chunk is replaced by the same KV written without the key (valid checksums).
* T, a restart, signing: X under ``a`` hits; X under ``b`` and without an adapter miss; W
  under ``s1`` hits, under ``s2`` and without a salt misses; P hits; the planted Q is never
  served. Every output equals R's.
* U, a fine-tune of the model (one weight tensor scaled) on the same store: P misses.
* V, the store made writable by every user: the engine refuses to start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvsnap.engines.vllm import read_events
from kvsnap.snapshot import Snapshot
from kvsnap.store import SnapshotWriter
from kvsnap.store.keys import new_key_text
from tests.support.vllm_engines import (
    HELPERS,
    PYTHON,
    EngineRun,
    finish_engine,
    launch_engine,
    run_engine,
)

pytestmark = pytest.mark.vllm

BLOCK = 32
CHUNK_BLOCKS = 2
LORA_RANK = 8
ADAPTERS = {"a": 1, "b": 2}


@dataclass
class Trust:
    tmp: Path
    prompts: dict[str, list[int]]
    runs: dict[str, EngineRun]
    store: Path
    planted: Path
    refused_log: str


def _prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(24)
    x, w, p = (rng.integers(1, 500, size=100).tolist() for _ in range(3))
    q = rng.integers(1, 500, size=80).tolist()
    return {
        **{label: x for label in ("X-a", "X-b", "X")},
        **{label: w for label in ("W-s1", "W-s2", "W")},
        "P": p,
        "Q": q,
    }


def _extras(adapters: Path) -> dict[str, dict]:
    def lora(name: str) -> dict:
        return {"lora": {"name": name, "id": ADAPTERS[name], "path": str(adapters / name)}}

    return {
        "X-a": lora("a"),
        "X-b": lora("b"),
        "W-s1": {"cache_salt": "s1"},
        "W-s2": {"cache_salt": "s2"},
    }


def _write_adapter(directory: Path, model: Path, seed: int) -> None:
    """A PEFT LoRA adapter of rank 8 on every layer's k_proj and v_proj, large enough to
    change the KV."""
    directory.mkdir(parents=True)
    config = json.loads((model / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    out = config["num_key_value_heads"] * config["head_dim"]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for projection in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{projection}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(LORA_RANK, hidden, generator=generator)
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, LORA_RANK, generator=generator)
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["k_proj", "v_proj"],
        "base_model_name_or_path": str(model),
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config))


def _fine_tune(model: Path, tuned: Path) -> None:
    """A copy of ``model`` with one weight tensor scaled: same architecture and config."""
    shutil.copytree(model, tuned)
    weights = tuned / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.self_attn.k_proj.weight"] *= 1.05
    save_file(tensors, weights, metadata={"format": "pt"})


def _strip_signature(chunk: Path) -> None:
    """Rewrite the chunk at ``chunk`` with the same KV and metadata but no signature: what
    anyone who can write the store, but holds no key, can plant (every checksum valid)."""
    with Snapshot.open(chunk) as snapshot:
        metadata = dataclasses.replace(snapshot.metadata, signature=None)
        pages = {
            name: snapshot.read_tensor(name).contiguous().view(torch.uint8).numpy().reshape(-1)
            for name in snapshot.geometry.tensor_names()
        }
    with SnapshotWriter(chunk, metadata) as writer:
        for name in writer.tensor_order():
            writer.write_pages(name, pages[name])


def _chunks(store: Path) -> list[Path]:
    return sorted(store.glob("*/chunks/*/*.safetensors"))


@pytest.fixture(scope="module")
def trust(tmp_path_factory: pytest.TempPathFactory) -> Trust:
    tmp = tmp_path_factory.mktemp("vllm-trust")
    model, tuned, adapters = tmp / "model", tmp / "tuned", tmp / "adapters"
    subprocess.run([str(PYTHON), str(HELPERS / "vllm_make_model.py"), str(model)], check=True)
    _fine_tune(model, tuned)
    for seed, name in enumerate(ADAPTERS, start=1):
        _write_adapter(adapters / name, model, seed)
    key = tmp / "store.key"
    key.write_text(new_key_text() + "\n")
    key.chmod(0o600)
    store = tmp / "store"
    prompts, extras = _prompts(), _extras(adapters)
    connector = {"path": str(store), "chunk_blocks": CHUNK_BLOCKS, "key_file": str(key)}
    common = {"enable_lora": True, "extras": extras}
    reference = launch_engine(tmp, "r", model, list(prompts), prompts, **common)
    stored = ["X-a", "W-s1", "P", "Q"]
    runs = {"s": run_engine(tmp, "s", model, stored, prompts, connector=connector, **common)}
    runs["r"] = finish_engine(reference[0], reference[1], list(prompts), *reference[2:])
    (q_chunk,) = [Path(event["path"]) for event in runs["s"].events_for("save", "Q")]
    _strip_signature(q_chunk)
    runs["t"] = run_engine(tmp, "t", model, list(prompts), prompts, connector=connector, **common)
    open_store = tmp / "open-store"
    shutil.copytree(store, open_store)
    open_store.chmod(0o777)
    refused = launch_engine(
        tmp, "v", model, ["P"], prompts, connector={**connector, "path": str(open_store)}
    )
    runs["u"] = run_engine(tmp, "u", tuned, ["P"], prompts, connector=connector)
    refused[0].wait(timeout=300)
    return Trust(tmp, prompts, runs, store, q_chunk, refused[2].read_text(errors="replace"))


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
