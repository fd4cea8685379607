"""The model check of a warm restore keeps its answer, and never serves a stale one (issue 26).

``check_snapshot_fits`` (every ``restore_dynamic_cache`` with a model) keeps the model's KV
geometry and fingerprint per model until the model changes
(``kvsnap.engines.weights.remembered_answer``). The claims under test, on the built-in tiny
Llama (a transformers model built from its config): a second check recomputes nothing, and
every change that changes what a snapshot of the model records (a config setting, an adapter
injected or deleted, a module renamed, a weight replaced or written in place) is seen, so a
snapshot of the model before the change is refused as a fresh model's check refuses it.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from kvsnap.engines import transformers as kt
from kvsnap.engines import weights
from kvsnap.engines.default_model import build_default_model
from kvsnap.engines.transformers import model as model_side
from kvsnap.errors import IncompatibleSnapshotError
from kvsnap.snapshot import Snapshot


class LoraLinear(torch.nn.Module):
    """A linear layer with low-rank adapters by name, as an adapter library injects one: the
    base layer plus, per adapter, ``B @ A`` of rank ``rank`` added to its output."""

    def __init__(self, base: torch.nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.rank = rank
        self.lora_a = torch.nn.ModuleDict()
        self.lora_b = torch.nn.ModuleDict()

    def add_adapter(self, name: str, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        down = torch.nn.Linear(self.base.in_features, self.rank, bias=False)
        up = torch.nn.Linear(self.rank, self.base.out_features, bias=False)
        with torch.no_grad():
            down.weight.copy_(torch.randn(down.weight.shape, generator=generator))
            up.weight.copy_(torch.randn(up.weight.shape, generator=generator))
        self.lora_a[name], self.lora_b[name] = down, up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for name, down in self.lora_a.items():
            out = out + self.lora_b[name](down(x))
        return out


@pytest.fixture()
def model() -> torch.nn.Module:
    return build_default_model()


def _snapshot_of(model: torch.nn.Module, path: Path) -> Path:
    ids = list(range(3, 40))
    [(cache, _)] = kt.prefill_token_ids(model, [ids])
    kt.capture_dynamic_cache(cache, [ids], path, model=model)
    return path


def _fits(path: Path, model: torch.nn.Module) -> bool:
    """Whether ``check_snapshot_fits`` lets the snapshot at ``path`` restore into ``model``."""
    with Snapshot.open(path) as snapshot:
        try:
            kt.check_snapshot_fits(snapshot, model)
        except IncompatibleSnapshotError:
            return False
    return True


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the calls that compute a model's answers: its geometry and its weights' samples."""
    counts = {"geometry": 0, "samples": 0}
    real_geometry, real_samples = model_side.geometry_for_model, weights._module_samples

    def geometry(*args, **kwargs):
        counts["geometry"] += 1
        return real_geometry(*args, **kwargs)

    def samples(*args, **kwargs):
        counts["samples"] += 1
        return real_samples(*args, **kwargs)

    monkeypatch.setattr(model_side, "geometry_for_model", geometry)
    monkeypatch.setattr(weights, "_module_samples", samples)
    return counts


def test_a_second_check_recomputes_nothing(model, tmp_path: Path, monkeypatch) -> None:
    path = _snapshot_of(model, tmp_path / "p.safetensors")
    counts = _counting(monkeypatch)
    assert _fits(path, model)
    # The capture computed the fingerprint; the first check computes the geometry.
    assert counts == {"geometry": 1, "samples": 0}
    for _ in range(3):
        assert _fits(path, model)
        kt.restore_dynamic_cache(path, model=model)
    assert counts == {"geometry": 1, "samples": 0}
    # A runtime flag the fingerprint leaves out is no change: still nothing recomputed.
    model.config.use_cache = not model.config.use_cache
    assert _fits(path, model)
    assert counts == {"geometry": 1, "samples": 0}


def test_a_config_setting_changed_in_place_is_seen(model, tmp_path: Path, monkeypatch) -> None:
    path = _snapshot_of(model, tmp_path / "p.safetensors")
    assert _fits(path, model)
    # RoPE's base changes every key, not the cache's shape: only the fingerprint sees it.
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_theta": 1234.0}
    assert not _fits(path, model)
    model.config.rope_parameters = build_default_model().config.rope_parameters
    assert _fits(path, model)
    # A change of shape is the geometry's: refused as a fresh check refuses it.
    model.config.num_key_value_heads = model.config.num_attention_heads
    with Snapshot.open(path) as snapshot, pytest.raises(IncompatibleSnapshotError, match="heads"):
        kt.check_snapshot_fits(snapshot, model)


def test_an_adapter_injected_then_deleted_is_seen(model, tmp_path: Path) -> None:
    base_path = _snapshot_of(model, tmp_path / "base.safetensors")
    attention = model.model.layers[1].self_attn
    assert _fits(base_path, model)
    attention.v_proj = LoraLinear(attention.v_proj)
    attention.v_proj.add_adapter("first", seed=1)
    assert not _fits(base_path, model)
    adapted_path = _snapshot_of(model, tmp_path / "adapted.safetensors")
    assert _fits(adapted_path, model)
    # What an adapter library's delete does: the adapter's modules leave their ModuleDicts.
    del attention.v_proj.lora_a["first"]
    del attention.v_proj.lora_b["first"]
    assert not _fits(adapted_path, model)


def test_a_module_renamed_in_place_is_seen(model) -> None:
    first = weights.loaded_model_fingerprint(model)
    attention = model.model.layers[0].self_attn
    # Same objects in the same order under another name: the parameters' names change.
    attention._modules = OrderedDict(
        ("k_proj_renamed" if name == "k_proj" else name, child)
        for name, child in attention._modules.items()
    )
    assert weights.loaded_model_fingerprint(model) != first


def test_a_weight_written_in_place_or_given_other_data_is_seen(model, tmp_path: Path) -> None:
    path = _snapshot_of(model, tmp_path / "p.safetensors")
    weight = model.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        weight.mul_(1.5)
    assert not _fits(path, model)
    with torch.no_grad():
        weight.div_(1.5)
    first = weights.loaded_model_fingerprint(model)
    # ``.data`` reassigned to a view of the same storage: same address, same version counter.
    weight.data = weight.data[: weight.shape[0] // 2]
    assert weights.loaded_model_fingerprint(model) != first
