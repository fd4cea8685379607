"""What issue 40 found wrong in the vLLM fs-tier and llama.cpp readers, each on real files.

An empty namespace is a tier that has stored nothing yet, not a damaged one; a file decodes
with one gather per tensor from an order built once per namespace; a conversion says which TP
size it assumed and names the one a page order reveals; a path no reader takes is refused
with what each reader found, and damage after a valid magic is damage (exit 1).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import kvsnap.foreign.vllm_fs as vllm_fs
from kvsnap.errors import LayoutError
from kvsnap.foreign import PageOrder, cell_order, load_page_order, open_foreign
from kvsnap.foreign.pages import decode_bytes, tile_pages
from tests.support.cli_runs import run_kvsnap

ROOT = Path(__file__).resolve().parents[2]
VLLM = ROOT / "fixtures" / "foreign" / "vllm-fs"
LLAMA = ROOT / "fixtures" / "foreign" / "llama-state"


def _namespace(tp: int) -> Path:
    [config] = (VLLM / f"tp{tp}" / "fs").glob("*/config.json")
    return config.parent


def test_a_namespace_that_stored_nothing_yet_verifies(tmp_path: Path) -> None:
    """vLLM writes config.json when the tier starts and <ns>_r0 at its first store."""
    namespace = tmp_path / _namespace(1).name
    shutil.copytree(_namespace(1), namespace)
    result = run_kvsnap("verify", str(namespace), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    payload = json.loads(result.stdout)
    assert payload["ok"] and payload["problems"] == []
    assert any("no block stored yet" in note for note in payload["notes"])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["cells-nhd", "cells-hnd"])
def test_a_file_decodes_as_its_pages_do(tp: int, name: str) -> None:
    """One gather over the whole file gives what decoding each worker's page gives."""
    layers, block, heads, dim = 3, 4, 4, 8
    order = cell_order(name, block, heads // tp, dim)
    page = order.elements
    data = torch.randn(layers * tp * page).to(torch.bfloat16)
    starts = [[(worker * layers + layer) * page for worker in range(tp)] for layer in range(layers)]
    raw = data.view(torch.uint8).numpy().tobytes()
    keys, values = decode_bytes(raw, torch.bfloat16, tile_pages(order, starts))
    for layer in range(layers):
        for worker in range(tp):
            start = starts[layer][worker]
            key, value = order.decode(data[start : start + page])
            heads_of = slice(worker * (heads // tp), (worker + 1) * (heads // tp))
            assert torch.equal(keys[layer][:, heads_of], key)
            assert torch.equal(values[layer][:, heads_of], value)


def test_the_page_order_is_read_once_per_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, every block reloaded the order file and rebuilt its index."""
    loads: list[Path] = []

    def counting(path: Path) -> PageOrder:
        loads.append(path)
        return load_page_order(path)

    monkeypatch.setattr(vllm_fs, "load_page_order", counting)
    prompt = json.loads((VLLM / "prompt.json").read_text())
    hints = {"model": str(VLLM), "page_order": str(VLLM / "tp1" / "page-order.npz")}
    with open_foreign(_namespace(1), tokens=prompt, **hints) as source:
        [sequence] = source.sequences()
        blocks = [source.read_block(block_id) for block_id in sequence.block_ids]
    assert len(blocks) == 3 and len(loads) == 1


def test_convert_says_which_tp_it_assumed(tmp_path: Path) -> None:
    prompt = str(VLLM / "prompt.json")
    order = str(VLLM / "tp1" / "page-order.npz")
    out = tmp_path / "one.safetensors"
    args = ("convert", str(VLLM / "tp1" / "fs"), "--tokens", prompt, "--model", str(VLLM))
    result = run_kvsnap(*args, "--page-order", order, "-o", str(out), "--json")
    assert result.returncode == 0, result.stderr
    [note] = json.loads(result.stdout)["notes"]
    assert note.startswith("TP 1 assumed") and "--tp N" in note
    assert "TP 1 assumed" in result.stderr
    given = run_kvsnap(*args, "--page-order", order, "--tp", "1", "-o", str(out), "--json")
    assert given.returncode == 0 and json.loads(given.stdout)["notes"] == []


def test_a_page_order_of_another_tp_is_refused_naming_it(tmp_path: Path) -> None:
    """TP 2's probed order holds one head per page: TP 1, assumed, cannot be the writer."""
    result = run_kvsnap(
        "convert",
        str(VLLM / "tp2" / "fs"),
        "--tokens",
        str(VLLM / "prompt.json"),
        "--model",
        str(VLLM),
        "--page-order",
        str(VLLM / "tp2" / "page-order.npz"),
        "-o",
        str(tmp_path / "two.safetensors"),
    )
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert "TP 2 writer" in line and "TP 1 was assumed" in line and "--tp 2" in line
    assert not (tmp_path / "two.safetensors").exists()
    with open_foreign(
        _namespace(2),
        model=str(VLLM),
        page_order=str(VLLM / "tp2" / "page-order.npz"),
        tp_size=4,
        tokens=json.loads((VLLM / "prompt.json").read_text()),
    ) as source:
        with pytest.raises(LayoutError, match="KV heads do not split over TP 4"):
            source.read_block(source.sequences()[0].block_ids[0])


def _layout_tree(tmp_path: Path) -> dict[str, Path]:
    empty = tmp_path / "empty"
    empty.mkdir()
    two = tmp_path / "two"
    shutil.copytree(VLLM / "tp1" / "fs", two)
    shutil.copytree(_namespace(1), two / f"other_{_namespace(1).name.rpartition('_')[2]}")
    orphan = tmp_path / "orphan" / f"{_namespace(1).name}_r0"
    shutil.copytree(_namespace(1).with_name(orphan.name), orphan)
    return {"empty": empty, "two": two, "orphan": orphan}


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_directories_no_reader_takes_say_what_each_found(tmp_path: Path, command: str) -> None:
    paths = _layout_tree(tmp_path)
    found = {
        "empty": "a directory without a vLLM fs-tier config.json",
        "two": "a vLLM fs-tier root with 2 namespaces",
        "orphan": f"namespace {_namespace(1).name}/config.json is missing",
    }
    for name, path in paths.items():
        result = run_kvsnap(command, str(path))
        assert result.returncode == 1, (name, result.stderr)
        [line] = result.stderr.strip().splitlines()
        assert "not a format kvsnap reads" in line and found[name] in line, line
        assert "llama-state: not a file" in line and "is a directory" not in line


def test_damage_after_a_llama_cpp_magic_exits_1(tmp_path: Path) -> None:
    rng = np.random.default_rng(40)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(struct.pack("<I", 0x67677371) + rng.bytes(300))
    counted = tmp_path / "counted.bin"
    counted.write_bytes(struct.pack("<III", 0x67677371, 3, 1 << 30) + rng.bytes(300))
    for path in (garbage, counted):
        for command in ("inspect", "verify"):
            result = run_kvsnap(command, str(path))
            assert result.returncode == 1, result.stderr
            assert len(result.stderr.strip().splitlines()) == 1
    older = tmp_path / "older.bin"
    older.write_bytes(struct.pack("<II", 0x67677371, 2) + os.urandom(64))
    result = run_kvsnap("verify", str(older))
    assert result.returncode == 2 and "version 2: kvsnap reads version 3" in result.stderr


def test_a_missing_hint_names_its_option(tmp_path: Path) -> None:
    result = run_kvsnap(
        "convert", str(LLAMA / "seq-flash.bin"), "-o", str(tmp_path / "x.safetensors")
    )
    assert result.returncode == 2 and "pass --kv-heads N" in result.stderr
    result = run_kvsnap(
        "convert",
        str(VLLM / "tp1" / "fs"),
        "--tokens",
        str(VLLM / "prompt.json"),
        "--page-order",
        "cells-nhd",
        "-o",
        str(tmp_path / "y.safetensors"),
    )
    assert result.returncode == 2 and "pass --model DIR" in result.stderr
