"""The runnable examples in the docs run as written (each checks its own result)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)


def test_custom_probe_example_in_components_md(capsys: pytest.CaptureFixture[str]) -> None:
    (block,) = [b for b in python_blocks("components.md") if "class MeanActivation(Probe)" in b]
    exec(compile(block, "docs/components.md", "exec"), {"__name__": "docs_example"})
    assert "probes/mean_activation/actor_mlp.layer_0/mean" in capsys.readouterr().out
