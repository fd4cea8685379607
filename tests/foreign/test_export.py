"""``kvsnap export``: snapshots written as a vLLM fs-tier namespace and a llama.cpp sequence
state, checked against the files vLLM and llama.cpp themselves wrote (fixtures/foreign/).

KVSnapConnector's dumps of the vLLM samples' prompt, exported with the probed page order, give
back vLLM's own block files byte for byte, at TP 1 and 2; the llama.cpp samples, converted and
exported, give back llama.cpp's own files byte for byte. vLLM's own lookup and loader read the
exported namespace (``-m vllm``); llama.cpp's own loader is the slow test in
``tests/foreign/test_llama_export.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvsnap.errors import IncompatibleSnapshotError
from kvsnap.foreign import convert_to_snapshot, open_foreign
from kvsnap.foreign.llama_state_export import export_llama_state
from kvsnap.foreign.vllm_fs_export import export_vllm_fs
from kvsnap.snapshot import Snapshot
from tests.support.cli_runs import run_kvsnap

ROOT = Path(__file__).resolve().parents[2]
VLLM = ROOT / "fixtures" / "foreign" / "vllm-fs"
LLAMA = ROOT / "fixtures" / "foreign" / "llama-state"
SGLANG = ROOT / "fixtures" / "foreign" / "sglang-hicache"


def _config(tp: int) -> Path:
    [config] = (VLLM / f"tp{tp}" / "fs").glob("*/config.json")
    return config


def _vllm_files(root: Path) -> dict[Path, bytes]:
    return {path.relative_to(root): path.read_bytes() for path in root.rglob("*.bin")}


@pytest.mark.parametrize("tp", [1, 2])
def test_export_writes_vllms_own_block_files(tmp_path: Path, tp: int) -> None:
    root = tmp_path / "fs"
    with Snapshot.open(VLLM / f"tp{tp}" / "dump" / "0.safetensors") as dump:
        result = export_vllm_fs(
            dump,
            root,
            page_order=str(VLLM / f"tp{tp}" / "page-order.npz"),
            config=_config(tp),
            tp_size=tp,
            model=VLLM,
        )
    assert len(result.written) == 3 and result.tokens_left_out == 0 and result.notes == []
    assert _vllm_files(root) == _vllm_files(VLLM / f"tp{tp}" / "fs")
    assert json.loads(next(root.glob("*/config.json")).read_text()) == json.loads(
        _config(tp).read_text()
    )
    with Snapshot.open(VLLM / f"tp{tp}" / "dump" / "0.safetensors") as dump:
        again = export_vllm_fs(dump, root, page_order="cells-nhd", tp_size=tp)
    assert again.written == [] and len(again.present) == 3  # as vLLM: a stored block is kept


def test_export_refuses_what_the_namespace_cannot_hold(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    shutil.copytree(_config(1).parent, root / _config(1).parent.name)
    order = str(VLLM / "tp1" / "page-order.npz")
    with Snapshot.open(SGLANG / "reference.safetensors") as other:  # 4 layers, heads of 32
        with pytest.raises(IncompatibleSnapshotError, match="layers: snapshot 4, namespace 2"):
            export_vllm_fs(other, root, page_order=order)
    with Snapshot.open(SGLANG / "mla" / "reference.safetensors") as mla:
        with pytest.raises(IncompatibleSnapshotError, match="MLA"):
            export_vllm_fs(mla, root, page_order=order)
    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((VLLM / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 1}))
    with Snapshot.open(VLLM / "tp1" / "dump" / "0.safetensors") as dump:
        with pytest.raises(IncompatibleSnapshotError, match=r"snapshot 2 x 32, .* 1 x 32"):
            export_vllm_fs(dump, root, page_order=order, model=model)
        with pytest.raises(IncompatibleSnapshotError, match="do not split over TP 3"):
            export_vllm_fs(dump, root, page_order="cells-nhd", tp_size=3, model=VLLM)
    fields = json.loads(_config(1).read_text())
    other_dtype = tmp_path / "float16.json"
    other_dtype.write_text(json.dumps({**fields, "dtype": "float16"}))
    with Snapshot.open(VLLM / "tp1" / "dump" / "0.safetensors") as dump:
        with pytest.raises(IncompatibleSnapshotError, match="dtype: snapshot bfloat16"):
            export_vllm_fs(dump, root, page_order=order, config=other_dtype)
    assert not list(root.rglob("*.bin"))


@pytest.mark.parametrize(
    ("name", "transposed"), [("seq-flash.bin", False), ("seq-noflash.bin", True)]
)
def test_llama_state_round_trip_is_byte_exact(tmp_path: Path, name: str, transposed: bool) -> None:
    """llama.cpp's file → kvsnap snapshot → llama.cpp's file again, the same bytes."""
    snapshot = tmp_path / "state.safetensors"
    with open_foreign(LLAMA / name, num_kv_heads=2) as source:
        convert_to_snapshot(source, snapshot)
    out = tmp_path / "exported.bin"
    with Snapshot.open(snapshot) as converted:
        assert export_llama_state(converted, out, v_transposed=transposed) == 40
    assert out.read_bytes() == (LLAMA / name).read_bytes()


def test_hf_rope_interleaves_each_heads_key_halves(tmp_path: Path) -> None:
    """llama.cpp keeps keys in interleaved rotary pairs; a transformers capture's halves are
    reordered (values untouched): dimension 2i holds i, 2i + 1 holds i + head_dim / 2."""
    out = tmp_path / "hf.bin"
    with Snapshot.open(SGLANG / "reference.safetensors") as captured:
        export_llama_state(captured, out, hf_rope=True)
        [record] = captured.sequences
        keys = captured.sequence_kv(record.id, "layers.1.key")
        values = captured.sequence_kv(record.id, "layers.1.value")
    with open_foreign(out, num_kv_heads=2, block_size=48) as source:
        block = source.read_block("0")
    half = keys.shape[-1] // 2
    assert torch.equal(block.keys[1][:, :, 0::2], keys[:, :, :half])
    assert torch.equal(block.keys[1][:, :, 1::2], keys[:, :, half:])
    assert torch.equal(block.values[1], values)


def test_llama_state_refusals(tmp_path: Path) -> None:
    with Snapshot.open(SGLANG / "mla" / "reference.safetensors") as mla:
        with pytest.raises(IncompatibleSnapshotError, match="MLA"):
            export_llama_state(mla, tmp_path / "x.bin")
    result = run_kvsnap("fixture", str(tmp_path / "two.safetensors"), "--lengths", "64,100")
    assert result.returncode == 0, result.stderr
    fp8 = tmp_path / "fp8.safetensors"
    assert (
        run_kvsnap("fixture", str(fp8), "--lengths", "16", "--dtype", "float8_e4m3fn").returncode
        == 0
    )
    with Snapshot.open(fp8) as eight:
        with pytest.raises(IncompatibleSnapshotError, match="dtype float8_e4m3fn"):
            export_llama_state(eight, tmp_path / "x.bin")
    exported = run_kvsnap(
        "export", str(tmp_path / "two.safetensors"), "--to", "llama-state", str(tmp_path / "y.bin")
    )
    assert exported.returncode == 2 and "name it with --sequence" in exported.stderr
    assert not (tmp_path / "y.bin").exists()


def test_cli_export(tmp_path: Path) -> None:
    dump = str(VLLM / "tp2" / "dump" / "0.safetensors.index.json")
    root = tmp_path / "fs"
    order = str(VLLM / "tp2" / "page-order.npz")
    common = ["export", dump, "--to", "vllm-fs", str(root)]
    missing = run_kvsnap(*common, "--page-order", order)
    assert missing.returncode == 2 and "--config FILE" in missing.stderr
    refused = run_kvsnap(*common, "--page-order", order, "--config", str(_config(2)))
    assert refused.returncode == 2 and "pass --tp 2" in refused.stderr
    done = run_kvsnap(*common, "--page-order", "cells-nhd", "--config", str(_config(2)), "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["written"] == 3 and payload["notes"] and "--tp N" in payload["notes"][0]
    verified = run_kvsnap("verify", str(root))
    assert verified.returncode == 0, verified.stdout
    no_order = run_kvsnap(*common)
    assert no_order.returncode == 2 and "--page-order is required" in no_order.stderr
    three = run_kvsnap(*common, "--page-order", "cells-nhd", "--tp", "3")
    assert three.returncode == 2 and "do not split over TP 3" in three.stderr
    state = tmp_path / "state.bin"
    llama = run_kvsnap("export", dump, "--to", "llama-state", str(state), "--json")
    assert llama.returncode == 0 and json.loads(llama.stdout)["tokens"] == 96
    with open_foreign(state, num_kv_heads=2) as source:
        assert source.verify() == [] and source.describe()["num_tokens"] == 96
    absent = run_kvsnap(
        "export", str(tmp_path / "none.safetensors"), "--to", "llama-state", str(state)
    )
    assert absent.returncode == 2 and "no such snapshot" in absent.stderr


@pytest.mark.vllm
def test_vllms_own_lookup_and_loader_read_the_export(tmp_path: Path) -> None:
    """vLLM's FileMapper names the exported namespace, its prefix-cache hashes of the prompt
    find every block through the fs tier's lookup, and its loader reads back vLLM's bytes."""
    root = tmp_path / "fs"
    with Snapshot.open(VLLM / "tp1" / "dump" / "0.safetensors") as dump:
        export_vllm_fs(
            dump, root, page_order=str(VLLM / "tp1" / "page-order.npz"), config=_config(1)
        )
    out = tmp_path / "read.json"
    config = next(root.glob("*/config.json"))
    subprocess.run(
        [
            str(ROOT / ".venv-vllm" / "bin" / "python"),
            str(ROOT / "tests" / "support" / "vllm_fs_read_back.py"),
            str(root),
            str(config),
            str(VLLM / "prompt.json"),
            str(out),
        ],
        check=True,
        capture_output=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    read = json.loads(out.read_text())
    assert read["found"] == [True, True, True]
    originals = {path.stem: path.read_bytes() for path in (VLLM / "tp1" / "fs").rglob("*.bin")}
    expected = b"".join(originals[digest] for digest in read["hashes"])
    assert Path(str(out) + ".bin").read_bytes() == expected
