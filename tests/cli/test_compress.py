"""``--compress`` from the command line: a capture stored fp8 shows its encoding, ratio and
recorded error in ``inspect`` (a lossless one its encoding, ratio and no error), and ``store
list`` shows each chunk's encoding and ratio; ``verify --against`` measures the error again and
fails when the file's report lies (text and ``--json``); ``convert`` re-encodes (lossless and
back to the byte-identical original); a bad value exits 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsnap.cli.app import app
from kvsnap.engines.vllm import CacheIdentity, PrefixStore, store_key_chain
from kvsnap.format import encoded as enc
from kvsnap.format.hashing import digest128, encode_trailer

runner = CliRunner()


def run_json(*args: str) -> tuple[int, dict]:
    result = runner.invoke(app, [*args, "--json"])
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("compress")
    prompts = ("-p", "The KV cache of a prompt, stored smaller", "-p", "Another prompt")
    original, fp8 = folder / "original.safetensors", folder / "fp8.safetensors"
    common = ("--dtype", "bfloat16", "--reproducible", *prompts)
    assert run_json("capture", "-o", str(original), *common)[0] == 0
    code, payload = run_json("capture", "-o", str(fp8), "--compress", "fp8", *common)
    assert code == 0 and payload["path"] == str(fp8)
    assert payload["encoding"]["name"] == "fp8" and payload["encoding"]["ratio"] > 1.5
    return original, fp8


def test_inspect_shows_the_encoding_ratio_and_recorded_error(captured):
    original, fp8 = captured
    code, payload = run_json("inspect", str(fp8))
    assert code == 0
    encoding = payload["encoding"]
    assert encoding["name"] == "fp8" and encoding["format_version"] == 3
    assert encoding["stored_bytes"] == fp8.stat().st_size
    assert encoding["decoded_bytes"] == original.stat().st_size
    assert encoding["ratio"] == pytest.approx(original.stat().st_size / fp8.stat().st_size, 1e-3)
    assert 0 < encoding["error"]["worst"]["rms_rel"] < 0.05
    assert run_json("inspect", str(original))[1]["encoding"] == {"name": "none"}
    text = runner.invoke(app, ["inspect", str(fp8)]).stdout
    assert "fp8 (kvsnap-fp8-e4m3-v1" in text and "RMS rel" in text


def test_inspect_of_an_fp8_snapshot_decodes_no_page_and_names_both_versions(captured, monkeypatch):
    original, fp8 = captured

    def decode(*args, **kwargs):
        raise AssertionError("inspect decoded the fp8 file")

    # Everything inspect shows comes from the header and the small tensors an open reads.
    monkeypatch.setattr("kvsnap.encoded.opening.decode", decode)
    code, payload = run_json("inspect", str(fp8))
    assert code == 0
    assert payload["format_version"] == 1 and payload["encoding"]["format_version"] == 3
    text = runner.invoke(app, ["inspect", str(fp8)]).stdout
    assert "v3: a v1 snapshot stored fp8" in text
    assert "v1 (kvsnap" in runner.invoke(app, ["inspect", str(original)]).stdout


def test_verify_against_the_original_measures_the_error_again(captured, tmp_path):
    original, fp8 = captured
    code, payload = run_json("verify", str(fp8), "--against", str(original))
    assert code == 0 and payload["ok"]
    assert payload["error"]["measured"] == payload["error"]["recorded"]
    # A file whose recorded error was edited (its trailer made to match): the claim is caught.
    liar = tmp_path / "liar.safetensors"
    liar.write_bytes(_with_edited_report(fp8))
    code, payload = run_json("verify", str(liar), "--against", str(original))
    assert code == 1 and "not the error measured" in payload["problems"][0]["message"]
    # The same for people: both measurements shown, one problem, exit 1.
    result = runner.invoke(app, ["verify", str(liar), "--against", str(original)])
    assert result.exit_code == 1 and "Traceback" not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("error measured against the reference: max abs") for line in lines)
    assert any(line.startswith("error recorded in the file: max abs") for line in lines)
    problems = [line for line in lines if line.startswith("problem:")]
    assert problems == [
        "problem: the error recorded in the file is not the error measured against the reference"
    ]
    assert "FAILED (1 problem(s))" in result.stdout
    honest = runner.invoke(app, ["verify", str(fp8), "--against", str(original)])
    assert honest.exit_code == 0 and "problem:" not in honest.stdout


def _with_edited_report(path: Path) -> bytes:
    data = np.fromfile(path, dtype=np.uint8)
    length = int(data[:8].view("<u8")[0])
    text = data[8 : 8 + length].tobytes()
    edited = text.replace(b'\\"rms_rel\\":0.0', b'\\"rms_rel\\":0.0001', 1)
    assert edited != text
    header = json.loads(edited[: edited.rindex(b"}") + 1])
    new_text = json.dumps(header, separators=(",", ":")).encode()
    new_text += b" " * (length - len(new_text))
    data[8 : 8 + length] = np.frombuffer(new_text, dtype=np.uint8)
    layout = enc.parse_header(data[: 8 + length].tobytes(), len(data))
    rows = [digest128(data[: layout.data_start].tobytes())]
    rows += [digest128(data[t.begin : t.end]) for t in layout.checksummed]
    trailer = layout.by_name[enc.ENCODED_CHECKSUMS_TENSOR]
    data[trailer.begin : trailer.end] = np.frombuffer(encode_trailer(rows), dtype=np.uint8)
    return data.tobytes()


def test_convert_reencodes_and_gives_the_original_back(captured, tmp_path):
    original, fp8 = captured
    lossless, back = tmp_path / "lossless.safetensors", tmp_path / "back.safetensors"
    code, payload = run_json(
        "convert", str(original), "-o", str(lossless), "--compress", "lossless"
    )
    assert code == 0 and payload["ratio"] > 1.0 and payload["error"] is None
    code, payload = run_json("verify", str(lossless), "--against", str(original))
    assert code == 0 and payload["ok"] and payload["problems"] == []
    assert [layer["max_abs_diff"] for layer in payload["comparison"]["layer_errors"]] == [0.0] * 4
    assert run_json("convert", str(lossless), "-o", str(back), "--compress", "none")[0] == 0
    assert back.read_bytes() == original.read_bytes()
    # fp8 re-encoded as fp8: quantized again (each (block, head) rescaled from its decoded
    # values), its report measured against the fp8 file's decode, which is what --against
    # measures again.
    again = tmp_path / "again.safetensors"
    assert run_json("convert", str(fp8), "-o", str(again), "--compress", "fp8")[0] == 0
    code, payload = run_json("verify", str(again), "--against", str(fp8))
    assert code == 0 and payload["error"]["measured"] == payload["error"]["recorded"]


def test_a_tolerance_given_compares_an_fp8_snapshot_token_by_token(captured):
    # --atol 0 is an exact comparison, not "no tolerance given" (which measures the error).
    original, fp8 = captured
    code, payload = run_json("verify", str(fp8), "--against", str(original), "--atol", "0")
    assert code == 1 and "error" not in payload
    layers = payload["comparison"]["layers"]
    assert all(layer["num_mismatches"] > 0 for layer in layers)
    worst = max(layer["max_abs_diff"] for layer in layers)
    code, payload = run_json("verify", str(fp8), "--against", str(original), "--atol", str(worst))
    assert code == 0 and payload["ok"] and "error" not in payload
    code, payload = run_json("verify", str(fp8), "--against", str(original), "--rtol", "0")
    assert code == 1 and "error" not in payload


def test_a_bad_compress_value_is_one_line_and_exit_2(captured, tmp_path):
    original, _ = captured
    result = runner.invoke(
        app, ["convert", str(original), "-o", str(tmp_path / "x"), "--compress", "zip"]
    )
    assert result.exit_code == 2
    assert "--compress zip: one of none, lossless, fp8" in result.stderr
    assert "Traceback" not in result.stderr


def test_inspect_of_a_lossless_snapshot_shows_its_encoding_ratio_and_no_error(captured, tmp_path):
    original, _ = captured
    lossless = tmp_path / "lossless.safetensors"
    assert run_json("convert", str(original), "-o", str(lossless), "--compress", "lossless")[0] == 0
    code, payload = run_json("inspect", str(lossless))
    assert code == 0
    encoding = payload["encoding"]
    assert (encoding["name"], encoding["codec"]) == ("lossless", "kvsnap-planes-zstd-v1")
    assert encoding["format_version"] == 3 and encoding["error"] is None
    assert encoding["stored_bytes"] == lossless.stat().st_size
    assert encoding["decoded_bytes"] == original.stat().st_size
    ratio = encoding["decoded_bytes"] / lossless.stat().st_size
    assert encoding["ratio"] == pytest.approx(ratio, abs=1e-4)
    assert encoding["ratio"] > 1.2 and encoding["tensors"] == {"lossless": 8}
    text = runner.invoke(app, ["inspect", str(lossless)]).stdout
    assert f"lossless (kvsnap-planes-zstd-v1): {encoding['ratio']:.2f}x smaller" in text
    assert "v3: a v1 snapshot stored lossless" in text
    assert "none: decodes bit for bit" in text


def test_store_list_shows_each_chunks_encoding_and_ratio(captured, tmp_path):
    original, fp8 = captured
    namespace = "03a56889058c2d76-bfloat16-b16-g1fffbbac"
    store = PrefixStore(tmp_path, namespace)
    chain = store_key_chain(list(range(48)), 16, CacheIdentity())
    plain, lossless, as_fp8 = (store.chunk_path(key) for key in chain)
    for chunk in (plain, lossless, as_fp8):
        chunk.parent.mkdir(parents=True, exist_ok=True)
    plain.write_bytes(original.read_bytes())
    as_fp8.write_bytes(fp8.read_bytes())
    assert run_json("convert", str(original), "-o", str(lossless), "--compress", "lossless")[0] == 0
    code, payload = run_json("store", "list", str(tmp_path))
    assert code == 0 and payload["count"] == 3
    listed = {tmp_path / entry["path"]: entry for entry in payload["entries"]}
    size = original.stat().st_size
    assert (listed[plain]["encoding"], listed[plain]["ratio"]) == ("none", 1.0)
    for chunk, name in ((lossless, "lossless"), (as_fp8, "fp8")):
        assert listed[chunk]["encoding"] == name
        assert listed[chunk]["ratio"] == pytest.approx(size / chunk.stat().st_size, abs=1e-4)
    # A small file: its header and metadata tensors weigh on fp8's ratio (about 2x of the KV).
    assert listed[as_fp8]["ratio"] > 1.5 and listed[lossless]["ratio"] > 1.2
    text = runner.invoke(app, ["store", "list", str(tmp_path)]).stdout
    # Rows: entry, parts, size (number and unit), encoding ("-", or name and ratio), age, state.
    rows = {cells[0]: cells for cells in map(str.split, text.splitlines()) if cells}
    for chunk, cell in (
        (plain, ["-"]),
        (lossless, ["lossless", f"{listed[lossless]['ratio']:.2f}x"]),
        (as_fp8, ["fp8", f"{listed[as_fp8]['ratio']:.2f}x"]),
    ):
        cells = rows[chunk.name.removesuffix(".safetensors")[:16] + "…"]
        assert cells[4 : 4 + len(cell)] == cell and cells[4 + len(cell)].isdigit(), cells
