"""The docs say what the code does (issue 25's drift): the keys ``inspect --json`` prints, the
version a reproducible fixture records, examples on the current transformers names, the vLLM
example runnable as a script, and the left-padding warning (checked on a real model)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvsnap.cli.app import app

DOCS = Path(__file__).resolve().parents[2] / "docs"
README = DOCS.parent / "README.md"
runner = CliRunner()


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


@pytest.fixture(scope="module")
def inspected(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("drift") / "fixture.safetensors"
    assert runner.invoke(app, ["fixture", str(path), "--lengths", "5"]).exit_code == 0
    result = runner.invoke(app, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_cli_md_names_every_key_of_inspect_json(inspected: dict) -> None:
    [row] = [
        line
        for line in (DOCS / "cli.md").read_text().splitlines()
        if line.startswith("| `--json` | JSON: ") and "`format_version`" in line
    ]
    named = set(re.findall(r"`([a-z_]+)`", row))
    assert set(inspected) <= named, set(inspected) - named


def test_fixtures_md_states_the_version_a_reproducible_fixture_records(inspected: dict) -> None:
    text = (DOCS / "fixtures.md").read_text()
    assert f'`"{inspected["kvsnap_version"]}"`' in text
    assert "currently\n  records the full `__version__`" not in text


def test_examples_use_the_current_cache_names() -> None:
    # transformers 5.2x names the cache `cache`; `past_key_values` is deprecated there.
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        for block in python_blocks(path):
            code = "\n".join(line.split("#")[0] for line in block.splitlines())
            assert "past_key_values" not in code, f"{path.name}: {block[:200]}"


def test_the_vllm_example_guards_the_engine_start() -> None:
    [example] = [block for block in python_blocks(DOCS / "vllm.md") if "LLM(" in block]
    guard = example.find('if __name__ == "__main__":')
    assert 0 <= guard < example.find("LLM(\n"), example
    assert "multiple of 32" in (DOCS / "vllm.md").read_text()


def test_the_readme_says_to_activate_the_venv() -> None:
    assert "source .venv/bin/activate" in README.read_text()


def test_left_padding_without_positions_shifts_the_kv_as_the_docs_warn() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    assert "Left padding and positions" in (DOCS / "transformers.md").read_text()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).eval()
    prompt = torch.tensor([[5, 17, 42, 7]])
    padded = torch.tensor([[0, 0, 0, 5, 17, 42, 7]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        alone = model(input_ids=prompt, use_cache=True).cache.layers[0].keys[..., -4:, :]
        shifted = model(input_ids=padded, attention_mask=mask, use_cache=True).cache
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        aligned = model(
            input_ids=padded, attention_mask=mask, position_ids=positions, use_cache=True
        ).cache
    assert not torch.allclose(shifted.layers[0].keys[..., -4:, :], alone, atol=1e-4)
    torch.testing.assert_close(aligned.layers[0].keys[..., -4:, :], alone, atol=1e-5, rtol=1e-5)


def _section(path: Path, title: str) -> str:
    text = path.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def test_the_readme_and_the_architecture_name_the_same_public_modules() -> None:
    import importlib

    table = _section(README, "Public API")
    public = re.findall(r"^\| `(kvsnap[\w.]*)` \|", table, flags=re.MULTILINE)
    assert {"kvsnap", "kvsnap.distributed", "kvsnap.engines.transformers"} <= set(public)
    described = _section(DOCS / "architecture.md", "Public modules")
    for module in public:
        importlib.import_module(module)
        assert f"`{module}`" in described, module
    # What it calls internal is no public module (but "the rest of" a partly public one).
    internal = set(re.findall(r"(?<!rest of )`(kvsnap\.\w+)`", table.split("Everything else")[1]))
    assert internal and not internal & set(public)


def test_the_source_tree_command_in_cli_md_is_the_one_that_works() -> None:
    """docs/cli.md named ``PYTHONPATH=. python -m kvsnap.cli``, which fails in a fresh clone
    (the app's source is ``cli/``); it names README's command, which runs."""
    import os
    import subprocess
    import sys

    command = "PYTHONPATH=. python -m cli"
    assert command in (DOCS / "cli.md").read_text() and command in README.read_text()
    assert "PYTHONPATH=. python -m kvsnap.cli" not in (DOCS / "cli.md").read_text()
    result = subprocess.run(
        [sys.executable, "-m", "cli", "--version"],
        cwd=DOCS.parent,
        env={**os.environ, "PYTHONPATH": "."},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and result.stdout.startswith("kvsnap "), result.stderr


def test_every_test_path_the_docs_name_exists() -> None:
    """docs/testing.md named ``tests/gpu/``, which no longer exists."""
    repo = DOCS.parent
    named = {
        match.split("::")[0].rstrip(".,:")
        for path in [*DOCS.glob("*.md"), README]
        for match in re.findall(r"(?<![\w/.-])tests/[\w/.\-]*", path.read_text())
    }
    assert named and not {path for path in named if not (repo / path).exists()}


def test_the_parted_write_sketch_uses_only_names_it_defines() -> None:
    """docs/format.md's sketch indexed ``plan[i]`` after naming the list ``parts``."""
    text = (DOCS / "format.md").read_text()
    sketch = text[text.index("**Writing.**") :]
    sketch = sketch[sketch.index("```text") : sketch.index("```", sketch.index("```text") + 3)]
    assigned = set(re.findall(r"^(\w+) = ", sketch, flags=re.MULTILINE))
    indexed = set(re.findall(r"(?<![\w.])(\w+)\[", sketch)) | set(
        re.findall(r"len\((\w+)\)", sketch)
    )
    assert indexed and indexed <= assigned, indexed - assigned
