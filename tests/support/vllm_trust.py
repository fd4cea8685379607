"""The trusted-store world of ``tests/engines/vllm/test_trust.py`` (its docstring names the
engines): a random-weight Llama, a fine-tune of it, two LoRA adapters, a signing key, one store.
R, the reference engine, is a job of its own; S, T, V and U one chain on the store
(``vllm_worlds.py``)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from kvsnap.snapshot import Snapshot
from kvsnap.store import SnapshotWriter
from kvsnap.store.files.keys import new_key_text
from tests.support.vllm_engines import EngineRun, launch_engine, run_engine
from tests.support.vllm_worlds import Job, World

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


@dataclass(frozen=True)
class _Inputs:
    tmp: Path
    model: Path
    tuned: Path
    prompts: dict[str, list[int]]
    connector: dict[str, str | int]
    common: dict[str, Any]  # LoRA on, and each prompt's adapter or salt


def _prepare(tmp: Path, model: Path) -> _Inputs:
    tuned, adapters = tmp / "tuned", tmp / "adapters"
    _fine_tune(model, tuned)
    for seed, name in enumerate(ADAPTERS, start=1):
        _write_adapter(adapters / name, model, seed)
    key = tmp / "store.key"
    key.write_text(new_key_text() + "\n")
    key.chmod(0o600)
    connector = {"path": str(tmp / "store"), "chunk_blocks": CHUNK_BLOCKS, "key_file": str(key)}
    common = {"enable_lora": True, "extras": _extras(adapters)}
    return _Inputs(tmp, model, tuned, _prompts(), connector, common)


def _reference(inputs: _Inputs) -> EngineRun:
    """R: every prompt on an engine without a connector, LoRA on, all of it in one process
    (the ``uni`` executor: the tokens of vLLM's default three processes for a third of the
    start-up). Nothing of R but its tokens is read."""
    tmp, model, prompts = inputs.tmp, inputs.model, inputs.prompts
    return run_engine(tmp, "r", model, list(prompts), prompts, executor="uni", **inputs.common)


def _store_runs(inputs: _Inputs) -> tuple[dict[str, EngineRun], Path, str]:
    """S, T, V and U on the store: their runs, the planted chunk, V's log."""
    tmp, model, prompts = inputs.tmp, inputs.model, inputs.prompts
    connector, common = inputs.connector, inputs.common
    stored = ["X-a", "W-s1", "P", "Q"]
    runs = {"s": run_engine(tmp, "s", model, stored, prompts, connector=connector, **common)}
    (q_chunk,) = [Path(event["path"]) for event in runs["s"].events_for("save", "Q")]
    _strip_signature(q_chunk)
    runs["t"] = run_engine(tmp, "t", model, list(prompts), prompts, connector=connector, **common)
    open_store = tmp / "open-store"
    shutil.copytree(connector["path"], open_store)
    open_store.chmod(0o777)
    refused = launch_engine(
        tmp, "v", model, ["P"], prompts, connector={**connector, "path": str(open_store)}
    )
    refused[0].wait(timeout=300)
    runs["u"] = run_engine(tmp, "u", inputs.tuned, ["P"], prompts, connector=connector)
    return runs, q_chunk, refused[2].read_text(errors="replace")


def _trust(inputs: _Inputs, results: dict[str, Any]) -> Trust:
    runs, planted, refused_log = results["store"]
    runs["r"] = results["reference"]
    store = Path(str(inputs.connector["path"]))
    return Trust(inputs.tmp, inputs.prompts, runs, store, planted, refused_log)


#: R beside the chain S, T, V (refused at its start), U.
WORLD = World(
    _prepare, {"reference": Job(_reference), "store": Job(_store_runs, engines=4)}, _trust
)
