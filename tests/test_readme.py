"""The README's Python quick start runs as written."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quick_start_runs(tmp_path, monkeypatch, capsys):
    text = README.read_text()
    match = re.search(r"<!-- this block is executed by tests/test_readme.py -->\n```python\n(.*?)```", text, re.S)
    assert match, "README lost its executed quick-start block"
    code = match.group(1)
    assert len(code.strip().splitlines()) <= 12
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    loss = float(re.search(r"loss ([\d.]+)", out).group(1))
    assert loss < 5.2  # byte-level text starts near ln(256) = 5.5 on the random-init tiny model
    assert (tmp_path / "adapter.safetensors").is_file()
