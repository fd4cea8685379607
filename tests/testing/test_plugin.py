"""The pytest plugin (golden KV snapshots), run through pytest's own ``pytester``.

The inner pytest runs are in-process (fast). pytester drops every module first imported during
an inner run when it ends, and re-importing a native extension afterwards (triton, torch
libraries pulled in by transformers) aborts the interpreter — the whole session, not just this
file. So :func:`_warm_imports` runs every code path the inner tests use once, before the first
pytester snapshot is taken.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import kvsnap.testing.synthetic  # noqa: F401  (imported by the inner tests; see the docstring)
from kvsnap.cli.app import app
from kvsnap.snapshot import Snapshot
from kvsnap.testing import assert_kv_matches, golden_path, plugin
from kvsnap.testing.golden import check_golden, kv_data, stored_compression, write_kv_snapshot

pytest_plugins = ["pytester"]

# A test module whose KV is seeded random tensors; KVSNAP_PERTURB="layer,token,head,delta"
# changes one key element, KVSNAP_ATOL sets the tolerance.
MAPPING_TEST = """
import os

import torch

from kvsnap.testing import assert_kv_matches


def make_kv():
    generator = torch.Generator().manual_seed(0)
    kv = {
        f"layers.{layer}.{part}": torch.randn((7, 2, 8), generator=generator)
        for layer in range(2)
        for part in ("key", "value")
    }
    perturb = os.environ.get("KVSNAP_PERTURB")
    if perturb:
        layer, token, head, delta = perturb.split(",")
        kv[f"layers.{layer}.key"][int(token), int(head), 3] += float(delta)
    return kv


def test_kv():
    assert_kv_matches(make_kv(), "mapping", atol=float(os.environ.get("KVSNAP_ATOL", "0")))
"""


@pytest.fixture(scope="module", autouse=True)
def _warm_imports(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Import and exercise, outside pytester, everything the inner tests import (see above)."""
    from kvsnap.transfer import available_backends

    available_backends()  # imports every copy backend, triton included
    scratch = tmp_path_factory.mktemp("warm")
    check_golden(_mapping_kv(), scratch / "warm.safetensors")
    check_golden(_mapping_kv(), scratch / "warm.safetensors")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    with torch.no_grad():
        transformers.LlamaForCausalLM(config).eval()(
            input_ids=torch.tensor([[1, 2]]), use_cache=True
        )


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """An in-process inner pytest run with the kvsnap plugin (auto-loaded through its entry point).

    hypothesis' and anyio's plugins are switched off there: pytester unloads their modules after
    every run, and re-importing hypothesis costs about two seconds per run.
    """
    return pytester.runpytest("-p", "no:hypothesispytest", "-p", "no:anyio", *args)


def _mapping_kv(perturb: tuple[int, int, int, float] | None = None) -> dict[str, torch.Tensor]:
    """The KV MAPPING_TEST builds (same seed, same draws)."""
    generator = torch.Generator().manual_seed(0)
    kv = {
        f"layers.{layer}.{part}": torch.randn((7, 2, 8), generator=generator)
        for layer in range(2)
        for part in ("key", "value")
    }
    if perturb:
        layer, token, head, delta = perturb
        kv[f"layers.{layer}.key"][token, head, 3] += delta
    return kv


def _read_kv(path: Path) -> dict[str, torch.Tensor]:
    with Snapshot.open(path) as snapshot:
        return {
            name: snapshot.sequence_kv("seq-0", name) for name in snapshot.geometry.tensor_names()
        }


def test_missing_golden_file_is_written_and_fails_then_the_rerun_passes(
    pytester: pytest.Pytester, request: pytest.FixtureRequest
) -> None:
    pytester.makepyfile(test_kv=MAPPING_TEST)
    result = _run(pytester)
    result.assert_outcomes(failed=1)
    # The nested session hands the running test back to the outer one.
    assert plugin._active_item is request.node
    result.stdout.fnmatch_lines(["*golden KV snapshot*mapping.safetensors did not exist*written*"])
    golden = pytester.path / "__kvsnap__" / "mapping.safetensors"
    stored = _read_kv(golden)
    for name, values in _mapping_kv().items():
        assert torch.equal(stored[name], values)
    before = golden.read_bytes()
    _run(pytester).assert_outcomes(passed=1)
    assert golden.read_bytes() == before


def test_mismatch_fails_with_the_verify_against_report(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytester.makepyfile(test_kv=MAPPING_TEST)
    _run(pytester)  # writes the golden file
    monkeypatch.setenv("KVSNAP_PERTURB", "1,4,1,0.25")
    result = _run(pytester)
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    assert "KV does not match the golden snapshot" in output
    assert "--kvsnap-update" in output
    # The report is exactly what `kvsnap verify ACTUAL --against GOLDEN` prints.
    actual = tmp_path / "actual.safetensors"
    write_kv_snapshot(kv_data(_mapping_kv((1, 4, 1, 0.25))), actual, block_size=16)
    golden = pytester.path / "__kvsnap__" / "mapping.safetensors"
    verify = CliRunner().invoke(app, ["verify", str(actual), "--against", str(golden)])
    assert verify.exit_code == 1
    report_lines = [
        line for line in verify.output.splitlines() if line.startswith(("layers.", "first"))
    ]
    assert len(report_lines) == 5
    for line in report_lines:
        assert line in output, line
    assert re.search(r"layers\.1\.key +0\.25 +seq-0 t4 h1 c\d+ +1 \(", output)
    assert re.search(r"layers\.0\.key +0 +- +0 \(0%\)", output)
    flat = " ".join(output.split())
    assert (
        "first difference beyond the tolerance: layer 1 (layers.1.key), sequence seq-0, "
        "token 4, head 1," in flat
    )
    # Within tolerance it passes.
    monkeypatch.setenv("KVSNAP_ATOL", "0.3")
    _run(pytester).assert_outcomes(passed=1)


def test_update_mode_rewrites_the_golden_file_and_passes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_kv=MAPPING_TEST)
    _run(pytester)
    golden = pytester.path / "__kvsnap__" / "mapping.safetensors"
    original = golden.read_bytes()
    monkeypatch.setenv("KVSNAP_PERTURB", "0,2,0,-1.5")
    result = _run(pytester, "--kvsnap-update")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["*kvsnap golden snapshots written*", "updated: *mapping.safetensors*"]
    )
    assert golden.read_bytes() != original
    for name, values in _mapping_kv((0, 2, 0, -1.5)).items():
        assert torch.equal(_read_kv(golden)[name], values)
    _run(pytester).assert_outcomes(passed=1)
    monkeypatch.delenv("KVSNAP_PERTURB")
    _run(pytester).assert_outcomes(failed=1)
    # An unchanged golden file is left alone in update mode.
    _run(pytester, "--kvsnap-update").assert_outcomes(passed=1)
    rewritten = golden.read_bytes()
    assert rewritten == original  # golden files are reproducible snapshots
    result = _run(pytester, "--kvsnap-update")
    result.assert_outcomes(passed=1)
    assert "kvsnap golden snapshots written" not in result.stdout.str()


def test_missing_golden_file_with_update_is_created_and_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kv=MAPPING_TEST)
    result = _run(pytester, "--kvsnap-update")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["created: *mapping.safetensors*"])
    assert (pytester.path / "__kvsnap__" / "mapping.safetensors").exists()


# A seeded random tiny Llama; ``prefill`` returns its DynamicCache after a forward pass.
LLAMA_MODEL = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

PROMPTS = [[1, 17, 42, 99, 7, 250, 3, 8, 64, 12], [1, 5, 5, 5, 5, 5, 5, 5, 5, 5]]


def prefill(input_ids):
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=True).past_key_values
"""

LLAMA_TEST = (
    LLAMA_MODEL
    + """
import os

from kvsnap.testing import assert_kv_matches


def test_prefill_kv():
    ids = [list(row) for row in PROMPTS]
    if os.environ.get("KVSNAP_PROMPT") == "edited":
        ids[0][5] = 251
    input_ids = torch.tensor(ids)
    assert_kv_matches(prefill(input_ids), "llama-prefill", token_ids=input_ids, block_size=4)
"""
)


def test_dynamic_cache_of_a_real_model_forward(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_llama=LLAMA_TEST)
    _run(pytester).assert_outcomes(failed=1)
    golden = pytester.path / "__kvsnap__" / "llama-prefill.safetensors"
    # The golden file holds exactly the model's cache: run the same model here.
    model: dict[str, Any] = {}
    exec(LLAMA_MODEL, model)
    model_cache = model["prefill"](torch.tensor(model["PROMPTS"]))
    with Snapshot.open(golden) as snapshot:
        for layer in range(2):
            for part, tensors in (("key", "keys"), ("value", "values")):
                for row in range(2):
                    stored = snapshot.sequence_kv(f"seq-{row}", f"layers.{layer}.{part}")
                    expected = getattr(model_cache.layers[layer], tensors)[row].transpose(0, 1)
                    assert torch.equal(stored, expected)
        assert [record.id for record in snapshot.sequences] == ["seq-0", "seq-1"]
        assert snapshot.geometry.num_kv_heads == 2 and snapshot.geometry.head_dim == 16
        assert snapshot.geometry.num_layers == 2 and snapshot.geometry.block_size == 4
        assert snapshot.sequences[1].token_ids.tolist() == [1] + [5] * 9
    _run(pytester).assert_outcomes(passed=1)
    # Editing token 5 changes the KV from token 5 on (causal attention), nothing before it.
    monkeypatch.setenv("KVSNAP_PROMPT", "edited")
    result = _run(pytester)
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    assert "sequence 'seq-0': token ids differ from token 5" in output
    flat = " ".join(output.split())
    assert (
        "first difference beyond the tolerance: layer 0 (layers.0.key), sequence seq-0, "
        "token 5, head 0" in flat
    )


SNAPSHOT_TEST = """
import os

from kvsnap.snapshot import Snapshot
from kvsnap.testing.synthetic import generate


def test_synthetic(kv_snapshot, tmp_path):
    path = tmp_path / "kv.safetensors"
    generate(
        path, num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, dtype="bfloat16",
        sequence_lengths=[12, 9], seed=int(os.environ.get("KVSNAP_SEED", "0")),
    )
    with Snapshot.open(path) as snapshot:
        kv_snapshot(snapshot)
    kv_snapshot.assert_matches(path, "by-path")
    assert kv_snapshot.path().name == "test_synthetic.safetensors"
"""


def test_kv_snapshot_fixture_takes_snapshots_and_paths(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_snap=SNAPSHOT_TEST)
    _run(pytester).assert_outcomes(failed=1)  # first golden file missing
    _run(pytester).assert_outcomes(failed=1)  # second golden file missing
    _run(pytester).assert_outcomes(passed=1)
    golden = pytester.path / "__kvsnap__" / "test_synthetic.safetensors"
    with Snapshot.open(golden) as snapshot:
        # The input snapshot's block size is kept.
        assert snapshot.geometry.block_size == 8
        assert [record.num_tokens for record in snapshot.sequences] == [12, 9]
    monkeypatch.setenv("KVSNAP_SEED", "1")
    result = _run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*token ids differ*", "*DIFFERENT:*beyond the tolerance*"])


FIXTURE_TEST = """
import os

import torch


def test_fixture(kv_snapshot):
    assert kv_snapshot.compression == (os.environ.get("KVSNAP_EXPECT") or None)
    generator = torch.Generator().manual_seed(3)
    kv = {part: torch.randn((9, 2, 8), generator=generator) for part in ("key", "value")}
    kv_snapshot({f"layers.0.{part}": tensor for part, tensor in kv.items()}, compression="lossless")
"""


def test_golden_files_are_written_lossless_when_asked(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_kv=MAPPING_TEST)
    golden = pytester.path / "__kvsnap__" / "mapping.safetensors"
    _run(pytester, "--kvsnap-compression", "lossless").assert_outcomes(failed=1)  # written
    assert stored_compression(golden) == "lossless"
    _run(pytester).assert_outcomes(passed=1)  # compared exactly, left as it is
    monkeypatch.setenv("KVSNAP_PERTURB", "1,4,1,0.25")
    _run(pytester).assert_outcomes(failed=1)
    _run(pytester, "--kvsnap-update").assert_outcomes(passed=1)
    assert stored_compression(golden) == "lossless"  # rewritten as it was stored
    for name, values in _mapping_kv((1, 4, 1, 0.25)).items():
        assert torch.equal(_read_kv(golden)[name], values)
    # The ini option; --kvsnap-update re-encodes a matching file stored otherwise.
    pytester.makeini("[pytest]\nkvsnap_compression = none\n")
    result = _run(pytester, "--kvsnap-update")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["updated: *mapping.safetensors*"])
    assert stored_compression(golden) == "none"
    # The command line overrides the ini option; so does the fixture's own argument.
    _run(pytester, "--kvsnap-update", "--kvsnap-compression", "lossless").assert_outcomes(passed=1)
    assert stored_compression(golden) == "lossless"
    pytester.makepyfile(test_fixture=FIXTURE_TEST)
    monkeypatch.setenv("KVSNAP_EXPECT", "none")
    _run(pytester, "test_fixture.py").assert_outcomes(failed=1)
    assert stored_compression(pytester.path / "__kvsnap__" / "test_fixture.safetensors") == (
        "lossless"
    )
    _run(pytester, "test_fixture.py").assert_outcomes(passed=1)
    pytester.makeini("[pytest]\nkvsnap_compression = fp8\n")
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*kvsnap_compression = 'fp8': one of none, lossless*"])
    pytester.makeini("[pytest]\n")
    result = _run(pytester, "--kvsnap-compression", "fp8")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvsnap-compression*invalid choice*fp8*"])


# --------------------------------------------------------------------------------------------
# Without pytester


def test_importing_the_plugin_does_not_import_torch() -> None:
    code = (
        "import sys, kvsnap.testing.plugin, kvsnap.testing; "
        "print(sorted(m for m in ('torch', 'numpy', 'kvsnap.snapshot') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_update_option_is_registered(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "--help")
    result.stdout.fnmatch_lines(["*--kvsnap-update*", "*--kvsnap-compression*"])
    result.stdout.fnmatch_lines(["*kvsnap_compression*"])


def test_assert_kv_matches_outside_a_test_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "_active_item", None)
    with pytest.raises(ValueError, match="inside a pytest test"):
        assert_kv_matches(_mapping_kv(), "anything")


@pytest.mark.parametrize("name", ["../escape", "a/b", "", ".hidden", "x\\y"])
def test_golden_names_cannot_leave_the_golden_directory(name: str) -> None:
    with pytest.raises(ValueError, match="plain file name"):
        golden_path(Path("tests/test_x.py"), name)


def test_sequence_structure_differences_are_mismatches(tmp_path: Path) -> None:
    golden = tmp_path / "g.safetensors"
    kv = _mapping_kv()
    assert check_golden(kv, golden).status == "missing"
    assert check_golden(kv, golden).status == "matched"
    # compare() names a difference in length (the golden path is the reference side).
    shorter = {name: values[:5] for name, values in kv.items()}
    result = check_golden(shorter, golden)
    assert result.status == "mismatch"
    report = " ".join(result.report.split())  # wrapped at 100 columns
    assert "sequence 'seq-0': 5 tokens in " in report
    assert f", 7 in {golden} (only the first 5 compared)" in report
    assert check_golden(shorter, golden, update=True).status == "updated"
    assert check_golden(shorter, golden).status == "matched"


def test_unreadable_golden_file_is_a_mismatch_and_update_replaces_it(tmp_path: Path) -> None:
    golden = tmp_path / "g.safetensors"
    golden.write_bytes(b"not a snapshot at all")
    result = check_golden(_mapping_kv(), golden)
    assert result.status == "mismatch"
    assert "cannot be read" in result.report
    assert check_golden(_mapping_kv(), golden, update=True).status == "updated"
    assert check_golden(_mapping_kv(), golden).status == "matched"


class _FakeLayer:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, is_sliding: bool = False) -> None:
        self.keys, self.values, self.is_sliding = keys, values, is_sliding


class _FakeCache:
    """Duck-typed like transformers' DynamicCache: ``layers[i].keys/values``."""

    def __init__(self, layers: list[_FakeLayer]) -> None:
        self.layers = layers


def test_rows_with_equal_token_ids_but_different_kv_are_refused(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn((2, 2, 8, 4), generator=generator)
    values = torch.randn((2, 2, 8, 4), generator=generator)
    same_ids = np.tile(np.arange(8), (2, 1))
    with pytest.raises(ValueError, match="same token ids up to token 4"):
        check_golden(
            _FakeCache([_FakeLayer(keys, values)]),
            tmp_path / "g.safetensors",
            token_ids=same_ids,
            block_size=4,
        )
    # Identical rows share their blocks legitimately; placeholder ids never collide.
    twin = _FakeCache(
        [_FakeLayer(keys[:1].expand(2, -1, -1, -1), values[:1].expand(2, -1, -1, -1))]
    )
    assert check_golden(
        twin, tmp_path / "twin.safetensors", token_ids=same_ids, block_size=4
    ).written
    distinct = check_golden(
        _FakeCache([_FakeLayer(keys, values)]), tmp_path / "d.safetensors", block_size=4
    )
    assert distinct.status == "missing"
    with Snapshot.open(tmp_path / "d.safetensors") as snapshot:
        assert snapshot.num_blocks == 4
        assert torch.equal(
            snapshot.sequence_kv("seq-1", "layers.0.value"), values[1].transpose(0, 1)
        )


def test_sliding_layers_are_recorded_and_truncated_windows_refused(tmp_path: Path) -> None:
    keys = torch.randn((1, 2, 6, 4))
    cache = _FakeCache([_FakeLayer(keys, keys, is_sliding=True), _FakeLayer(keys, keys)])
    data = kv_data(cache)
    assert data.attention_types == ("sliding", "full")
    window = _FakeCache(
        [_FakeLayer(keys[:, :, 2:], keys[:, :, 2:], is_sliding=True), _FakeLayer(keys, keys)]
    )
    with pytest.raises(ValueError, match="sliding-window layers keep only their window"):
        kv_data(window)


def test_mla_latents_and_incomplete_mappings(tmp_path: Path) -> None:
    latents = {
        f"layers.{layer}.latent": torch.randn((9, 24)).to(torch.bfloat16) for layer in range(3)
    }
    golden = tmp_path / "mla.safetensors"
    assert check_golden(latents, golden, block_size=4).status == "missing"
    assert check_golden(latents, golden).status == "matched"
    with Snapshot.open(golden) as snapshot:
        assert snapshot.geometry.latent_dim == 24 and snapshot.geometry.block_size == 4
    changed = dict(latents)
    changed["layers.2.latent"] = latents["layers.2.latent"].clone()
    changed["layers.2.latent"][8, 23] += 1
    result = check_golden(changed, golden)
    assert result.status == "mismatch"
    report = " ".join(result.report.split())
    assert (
        "first difference beyond the tolerance: layer 2 (layers.2.latent), sequence seq-0, "
        "token 8, head 0, channel 23" in report
    )
    with pytest.raises(ValueError, match="incomplete KV mapping"):
        kv_data({"layers.0.key": torch.zeros((3, 1, 4)), "layers.1.value": torch.zeros((3, 1, 4))})
    with pytest.raises(ValueError, match="not layers"):
        kv_data({"layer0.key": torch.zeros((3, 1, 4))})
    with pytest.raises(ValueError, match="token_ids row 0"):
        kv_data(latents, token_ids=np.arange(5))


def test_golden_json_report_matches_verify_exit_code(tmp_path: Path) -> None:
    golden = tmp_path / "g.safetensors"
    check_golden(_mapping_kv(), golden)
    actual = tmp_path / "a.safetensors"
    write_kv_snapshot(kv_data(_mapping_kv((0, 6, 1, 2.0))), actual, block_size=16)
    verify = CliRunner().invoke(app, ["verify", str(actual), "--against", str(golden), "--json"])
    assert verify.exit_code == 1
    problems = json.loads(verify.output)["problems"]
    assert [problem["tensor"] for problem in problems] == ["layers.0.key"]
    assert check_golden(_mapping_kv((0, 6, 1, 2.0)), golden).status == "mismatch"


def test_golden_files_record_their_name_as_the_model_id(tmp_path: Path) -> None:
    golden = tmp_path / "prefill-kv.safetensors"
    assert check_golden(_mapping_kv(), golden).status == "missing"
    with Snapshot.open(golden) as snapshot:
        assert snapshot.metadata.source.model_id == "prefill-kv"  # not a tensor name
        assert snapshot.metadata.source.engine == "kvsnap-golden"
    plain = tmp_path / "plain.safetensors"
    write_kv_snapshot(kv_data(_mapping_kv()), plain, block_size=4)
    with Snapshot.open(plain) as snapshot:
        assert snapshot.metadata.source.model_id == "golden"
