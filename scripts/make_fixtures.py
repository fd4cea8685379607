"""Write the committed format fixtures: small synthetic snapshots, one per layout and attention.

    python scripts/make_fixtures.py            # write the current format version's fixtures
    python scripts/make_fixtures.py --check    # exit 1 if any committed fixture would change
    python scripts/make_fixtures.py --force    # rewrite fixtures whose bytes would change
    python scripts/make_fixtures.py --encoded  # the same for fixtures/encoded-v3/

``--encoded`` writes ``fixtures/encoded-v3/``: encoded snapshots (format version 3) of a few of
the current version's fixtures, lossless and fp8, one fp8 file signed with
:data:`ENCODED_FIXTURE_KEY`; its manifest names each file's source fixture, encoding, the
kvsnap version that wrote it, byte count and SHA-256.

Files go to ``fixtures/v{FORMAT_VERSION}/`` with a ``manifest.json`` listing, per file, the
:func:`kvsnap.testing.synthetic.generate` arguments, the byte count and the SHA-256.
tests/format/test_fixtures.py reads every fixture of every format version on each run, and
checks that the current kvsnap regenerates the current version's files byte for byte.

A fixture of a released format version is a promise that kvsnap keeps reading it: the script
never changes an existing file unless ``--force`` is given (only for a format version still in
development, or after a deliberate generator change that bumps ``GENERATOR_VERSION``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(REPO))

from kvsnap.format import FORMAT_VERSION  # noqa: E402
from kvsnap.testing.synthetic import GENERATOR_VERSION, generate, make_spec  # noqa: E402

_SMALL = {"num_layers": 2, "block_size": 4, "num_kv_heads": 2, "head_dim": 16}

#: Every fixture: file stem -> generate() keyword arguments. Each layout, each attention type
#: and several dtypes appear; sizes stay at a few KiB (pages are 4096-aligned in the file).
FIXTURES: dict[str, dict[str, Any]] = {
    "full-vllm-split-nhd-bf16": {
        **_SMALL,
        "layout": "vllm-split-nhd",
        "dtype": "bfloat16",
        "sequence_lengths": [9, 6],
        "seed": 1,
    },
    "full-vllm-split-hnd-f16": {
        **_SMALL,
        "layout": "vllm-split-hnd",
        "dtype": "float16",
        "sequence_lengths": [9, 6],
        "seed": 2,
    },
    "full-packed-f32": {
        **_SMALL,
        "layout": "packed",
        "dtype": "float32",
        "sequence_lengths": [9, 6],
        "seed": 3,
    },
    "full-legacy-bf16-mqa": {
        **_SMALL,
        "num_kv_heads": 1,
        "head_dim": 8,
        "layout": "legacy",
        "dtype": "bfloat16",
        "sequence_lengths": [9, 6],
        "seed": 4,
    },
    "full-flat-paged-f16": {
        **_SMALL,
        "layout": "flat-paged",
        "dtype": "float16",
        "sequence_lengths": [9, 6],
        "seed": 5,
    },
    "full-cross-layer-f8e4m3": {
        **_SMALL,
        "layout": "cross-layer",
        "dtype": "float8_e4m3fn",
        "sequence_lengths": [9, 6],
        "seed": 6,
    },
    "full-vllm-split-nhd-f8e5m2-single": {
        **_SMALL,
        "layout": "vllm-split-nhd",
        "dtype": "float8_e5m2",
        "sequence_lengths": [3],
        "seed": 7,
    },
    "sliding-vllm-split-nhd-bf16-shared": {
        **_SMALL,
        "attention": "sliding",
        "layout": "vllm-split-nhd",
        "dtype": "bfloat16",
        "sequence_lengths": [10, 7],
        "shared_prefix_tokens": 6,
        "seed": 8,
    },
    "mla-bf16-shared": {
        "num_layers": 2,
        "block_size": 4,
        "attention": "mla",
        "latent_dim": 36,
        "layout": "mla",
        "dtype": "bfloat16",
        "sequence_lengths": [9, 6],
        "shared_prefix_tokens": 4,
        "seed": 9,
    },
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(directory: Path) -> list[dict[str, Any]]:
    """Write every fixture into ``directory``; returns the manifest entries."""
    entries = []
    for stem, arguments in FIXTURES.items():
        path = directory / f"{stem}.safetensors"
        generate(path, **arguments)
        spec = make_spec(**arguments)  # normalized arguments, as recorded in the manifest
        entries.append(
            {
                "file": path.name,
                "arguments": spec.arguments(),
                "bytes": path.stat().st_size,
                "sha256": sha256(path),
            }
        )
    return entries


#: Encoded fixtures: file stem -> (source fixture stem, encoding, signed).
ENCODED_FIXTURES: dict[str, tuple[str, str, bool]] = {
    "vllm-split-nhd-bf16.lossless": ("full-vllm-split-nhd-bf16", "lossless", False),
    "vllm-split-nhd-bf16.fp8": ("full-vllm-split-nhd-bf16", "fp8", False),
    "vllm-split-nhd-bf16.fp8-signed": ("full-vllm-split-nhd-bf16", "fp8", True),
    "packed-f32.lossless": ("full-packed-f32", "lossless", False),
    "packed-f32.fp8": ("full-packed-f32", "fp8", False),
    "mla-bf16.lossless": ("mla-bf16-shared", "lossless", False),
    "mla-bf16.fp8": ("mla-bf16-shared", "fp8", False),
    "cross-layer-f8e4m3.fp8": ("full-cross-layer-f8e4m3", "fp8", False),  # stored raw
}
#: The key the signed encoded fixture is signed with (a test key: 32 known bytes).
ENCODED_FIXTURE_KEY = bytes(range(32))


def build_encoded(directory: Path, sources: Path) -> list[dict[str, Any]]:
    """Write every encoded fixture into ``directory`` from the fixtures in ``sources``;
    returns the manifest entries."""
    from kvsnap import __version__
    from kvsnap.encoded.write import encode_file
    from kvsnap.format.signing import KeyRing

    entries = []
    for stem, (source, encoding, signed) in ENCODED_FIXTURES.items():
        path = directory / f"{stem}.safetensors"
        keys = KeyRing([ENCODED_FIXTURE_KEY]) if signed else None
        encode_file(sources / f"{source}.safetensors", path, encoding, keys=keys)
        entries.append(
            {
                "file": path.name,
                "source": f"{source}.safetensors",
                "encoding": encoding,
                "signed": signed,
                "kvsnap_version": __version__,
                "bytes": path.stat().st_size,
                "sha256": sha256(path),
            }
        )
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=REPO / "fixtures" / f"v{FORMAT_VERSION}",
        help="where to write (default: fixtures/v<current format version>)",
    )
    parser.add_argument(
        "--check", action="store_true", help="only report fixtures that would change"
    )
    parser.add_argument("--force", action="store_true", help="rewrite fixtures whose bytes change")
    parser.add_argument(
        "--encoded",
        action="store_true",
        help="write the encoded fixtures (default directory: fixtures/encoded-v3)",
    )
    args = parser.parse_args(argv)
    if args.encoded and args.output_dir == parser.get_default("output_dir"):
        args.output_dir = REPO / "fixtures" / "encoded-v3"

    with tempfile.TemporaryDirectory(prefix="kvsnap-fixtures-") as scratch:
        fresh = Path(scratch)
        sources = REPO / "fixtures" / f"v{FORMAT_VERSION}"
        entries = build_encoded(fresh, sources) if args.encoded else build(fresh)
        changed = [
            entry["file"]
            for entry in entries
            if (args.output_dir / entry["file"]).exists()
            and (args.output_dir / entry["file"]).read_bytes()
            != (fresh / entry["file"]).read_bytes()
        ]
        missing = [
            entry["file"] for entry in entries if not (args.output_dir / entry["file"]).exists()
        ]
        if args.check:
            for name in changed:
                print(f"would change: {name}")
            for name in missing:
                print(f"missing: {name}")
            return 1 if changed or missing else 0
        if changed and not args.force:
            for name in changed:
                print(f"refusing to change committed fixture {name} (use --force)", file=sys.stderr)
            return 1
        args.output_dir.mkdir(parents=True, exist_ok=True)
        for entry in entries:
            (args.output_dir / entry["file"]).write_bytes((fresh / entry["file"]).read_bytes())
    manifest = {
        "format_version": 3 if args.encoded else FORMAT_VERSION,
        **({} if args.encoded else {"generator_version": GENERATOR_VERSION}),
        "written_by": "scripts/make_fixtures.py" + (" --encoded" if args.encoded else ""),
        "fixtures": entries,
    }
    (args.output_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(entry["bytes"] for entry in entries)
    print(f"{len(entries)} fixtures, {total} bytes in {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
