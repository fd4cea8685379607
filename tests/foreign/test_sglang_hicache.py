"""SGLang HiCache's file storage, read from files SGLang's own code wrote
(fixtures/foreign/sglang-hicache, ``scripts/make_sglang_fixtures.py``).

The samples hold one 48-token prompt (3 pages of 16) of the built-in tiny Llama (4 layers, 2 KV
heads of 32, bfloat16), stored by SGLang 0.5.23's ``HiCacheFile`` from its ``MHATokenToKVPoolHost``
in each host layout at TP 1 and 2, and random MLA latents (2 layers, 48 wide) from its
``MLATokenToKVPoolHost``, with kvsnap's captures of the same KV to compare with. No SGLang is
needed: the tests read the committed files.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvsnap.errors import LayoutError, SnapshotCorruptError
from kvsnap.foreign import convert_to_snapshot, open_foreign, recognise
from kvsnap.foreign.sglang_hicache import LAYOUTS, page_hashes
from kvsnap.snapshot import Snapshot
from tests.support.cli_runs import run_kvsnap

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures" / "foreign" / "sglang-hicache"
PROMPT = json.loads((FIXTURES / "prompt.json").read_text())


def _mismatches(converted: Path, reference: Path) -> int:
    with Snapshot.open(converted) as mine, Snapshot.open(reference) as theirs:
        assert mine.verify() == []
        comparison = mine.compare(theirs)
    assert comparison.problems == [] and comparison.layers
    return sum(layer.num_mismatches for layer in comparison.layers)


def test_page_names_are_sglangs_page_hashes() -> None:
    """SGLang's C++ hash named the files; kvsnap's recomputation finds every one of them."""
    names = {path.name.split("_")[0] for path in (FIXTURES / "layer_first" / "tp1").iterdir()}
    assert set(page_hashes(PROMPT, 16)) == names and len(names) == 3
    assert page_hashes(PROMPT[:15], 16) == []


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tp", [1, 2])
def test_converted_pages_equal_the_kv_sglang_held(tmp_path: Path, layout: str, tp: int) -> None:
    out = tmp_path / "converted.safetensors"
    hints = {"model": str(FIXTURES), "page_order": layout, "tokens": PROMPT}
    with open_foreign(FIXTURES / layout / f"tp{tp}", **hints) as source:
        [sequence] = source.sequences()
        assert len(sequence.block_ids) == 3 and source.geometry().block_size == 16
        convert_to_snapshot(source, out, engine=source.engine)
    assert _mismatches(out, FIXTURES / "reference.safetensors") == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_latents_equal_what_sglang_held(tmp_path: Path, layout: str) -> None:
    """MLA pages: one file per page for every rank (no TP in the name), a latent per token."""
    out = tmp_path / "mla.safetensors"
    mla = FIXTURES / "mla"
    hints = {"model": str(mla), "page_order": layout, "tokens": PROMPT}
    with open_foreign(mla / layout, **hints) as source:
        assert source.geometry().latent_dim == 48 and source.geometry().is_mla
        [deployment] = source.describe()["deployments"]
        assert deployment["mla"] and deployment["files"] == 3
        convert_to_snapshot(source, out)
    assert _mismatches(out, mla / "reference.safetensors") == 0


def test_the_wrong_layout_decodes_other_kv(tmp_path: Path) -> None:
    """The layout is a real hint: page_first files read as layer_first give other KV (and
    layer_first and page_first_direct pages are the same bytes)."""
    out = tmp_path / "wrong.safetensors"
    hints = {"model": str(FIXTURES), "page_order": "layer_first", "tokens": PROMPT}
    with open_foreign(FIXTURES / "page_first" / "tp1", **hints) as source:
        convert_to_snapshot(source, out)
    assert _mismatches(out, FIXTURES / "reference.safetensors") > 0
    for first, direct in zip(
        sorted((FIXTURES / "layer_first" / "tp2").iterdir()),
        sorted((FIXTURES / "page_first_direct" / "tp2").iterdir()),
        strict=True,
    ):
        assert first.read_bytes() == direct.read_bytes()


def test_recognised_and_described() -> None:
    directory = FIXTURES / "layer_first" / "tp2"
    assert recognise(directory).name == "sglang-hicache"
    assert recognise(next(directory.iterdir())).name == "sglang-hicache"
    assert recognise(FIXTURES) is None  # the samples' root: no page file right in it
    with open_foreign(directory) as source:
        info = source.describe()
        assert source.verify() == []
    [deployment] = info["deployments"]
    assert deployment == {
        "model": "kvsnap-tiny-llama",
        "tp_size": 2,
        "mla": False,
        "pages": 3,
        "files": 6,
        "file_bytes": [8192],
    }


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURES / "layer_first" / "tp2", tmp_path / "hicache")
    return tmp_path / "hicache"


def test_damaged_directories_are_found(tmp_path: Path) -> None:
    directory = _copy(tmp_path)
    files = sorted(directory.iterdir())
    files[0].write_bytes(files[0].read_bytes()[:100])
    files[3].unlink()
    (directory / f".{'ab' * 16}.tmp").write_bytes(b"partial")
    with open_foreign(directory) as source:
        messages = [problem.message for problem in source.verify()]
    assert "100 bytes, the other files have 8192" in messages
    assert "a temporary file of an interrupted write" in messages
    assert any("missing rank(s) [1] of TP 2" in message for message in messages)
    hints = {"model": str(FIXTURES), "page_order": "layer_first", "tokens": PROMPT}
    with open_foreign(directory, **hints) as source:
        # The first page's rank 1 file is gone: the prompt's run of stored pages is empty.
        [sequence] = source.sequences()
        assert sequence.block_ids == ()
        with pytest.raises(SnapshotCorruptError, match="100 bytes"):
            source.read_block(files[0].name.split("_")[0])


def test_hints_the_files_cannot_replace(tmp_path: Path) -> None:
    directory = FIXTURES / "layer_first" / "tp1"
    with open_foreign(directory, tokens=PROMPT) as source:
        with pytest.raises(LayoutError, match="pass --model DIR"):
            source.sequences()
    with open_foreign(directory, tokens=PROMPT, model=str(FIXTURES)) as source:
        with pytest.raises(LayoutError, match="pass --page-order layer_first or page_first"):
            source.read_block(source.sequences()[0].block_ids[0])
    other = tmp_path / "model"
    other.mkdir()
    config = json.loads((FIXTURES / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "head_dim": 24}))
    with open_foreign(directory, tokens=PROMPT, model=str(other)) as source:
        with pytest.raises(LayoutError, match="not whole tokens"):
            source.sequences()


def test_cli_on_hicache_directories(tmp_path: Path) -> None:
    directory = _copy(tmp_path)
    inspected = run_kvsnap("inspect", str(directory), "--json")
    assert inspected.returncode == 0 and json.loads(inspected.stdout)["num_files"] == 6
    verified = run_kvsnap("verify", str(directory))
    assert verified.returncode == 0 and "no checksums" in verified.stdout
    out = tmp_path / "out.safetensors"
    common = ["--model", str(FIXTURES), "--page-order", "layer_first", "-o", str(out)]
    missing = run_kvsnap("convert", str(directory), *common)
    assert missing.returncode == 2 and "--tokens FILE is required" in missing.stderr
    converted = run_kvsnap(
        "convert", str(directory), *common, "--tokens", str(FIXTURES / "prompt.json"), "--json"
    )
    assert converted.returncode == 0, converted.stderr
    assert json.loads(converted.stdout)["tokens"] == 48
    compared = run_kvsnap("verify", str(out), "--against", str(FIXTURES / "reference.safetensors"))
    assert compared.returncode == 0, compared.stdout
    with Snapshot.open(out) as snapshot:
        assert snapshot.metadata.source.engine == "sglang"
    page = sorted(directory.iterdir())[0]
    page.write_bytes(page.read_bytes()[:-2])
    broken = run_kvsnap("verify", str(directory))
    assert broken.returncode == 1 and "8190 bytes" in broken.stdout
    converted = run_kvsnap(
        "convert", str(directory), *common, "--tokens", str(FIXTURES / "prompt.json")
    )
    assert converted.returncode == 1 and "8190 bytes, a page of 16 tokens" in converted.stderr
    assert len(converted.stderr.strip().splitlines()) == 1
    page.write_bytes(b"")
    empty = run_kvsnap("verify", str(directory))
    assert empty.returncode == 1 and "0 bytes" in empty.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="SGLang is not installed: see scripts/make_sglang_fixtures.py",
)
def test_sglang_writes_what_the_fixtures_hold(tmp_path: Path) -> None:
    """SGLang's own code, run afresh, writes the committed files byte for byte."""
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_sglang_fixtures.py"), str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    for committed in FIXTURES.rglob("*"):
        if committed.is_file() and committed.name != "versions.json":
            fresh = tmp_path / committed.relative_to(FIXTURES)
            assert fresh.read_bytes() == committed.read_bytes(), committed
