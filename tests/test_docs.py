"""The documentation site builds without a warning, and the README stays a short entry point into it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# The README's two set-up commands, exactly as a newcomer copies them (.ci/run runs the second).
SETUP_BLOCK = """```bash
tools/demo    # creates .venv, installs edgetrain, profiles a LoRA step: mesp against autograd (a minute)
tools/test    # creates/updates .venv with the dev extras, installs the test data, runs every test (what CI runs)
```"""

MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_docs_site_builds_with_no_warning(tmp_path):
    # --strict turns every warning into a failure: a broken page link or anchor, a page left out of the
    # nav, a docstring mkdocstrings cannot render, a hook that raises.
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    # The generated pages hold what they are generated from.
    cli = (site / "cli" / "index.html").read_text(encoding="utf-8")
    assert "<!-- cli-reference -->" not in cli  # the marker was replaced
    for flag in ("--checkpoint-dir", "--quantize-bits", "--batch-file", "--overlap"):
        assert flag in cli, f"the CLI reference lacks {flag}"
    assert "agx-orin-32gb" in (site / "devices" / "index.html").read_text(encoding="utf-8")
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert 'id="edgetrain.training.learner.Learner"' in api


def test_the_readme_is_short_keeps_the_set_up_commands_and_links_to_pages_that_exist():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 200, "README.md is an entry point; reference material belongs in docs/"
    assert SETUP_BLOCK in text, "README.md lost its two set-up commands (or changed them)"
    targets = [target.split("#")[0] for target in MARKDOWN_LINK.findall(text)
               if not re.match(r"[a-z]+:", target) and not target.startswith("#")]
    docs_pages = [target for target in targets if target.startswith("docs/") and target.endswith(".md")]
    assert len(docs_pages) >= 10, f"README.md links to only {docs_pages} in docs/"
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_package_picture_in_the_docs_is_the_codes():
    # docs/layout.md's picture of edgetrain/ is drawn from the code by tools/package_map.py: a module moved,
    # added or removed without redrawing it fails here.
    result = subprocess.run([sys.executable, "tools/package_map.py", "--check"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_package_picture_lists_every_module_of_the_package():
    import importlib.util

    spec = importlib.util.spec_from_file_location("package_map", ROOT / "tools" / "package_map.py")
    package_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(package_map)
    tree = package_map.picture().split("```text", 1)[1].split("```", 1)[0]
    listed = [line.split()[0] for line in tree.splitlines() if line.strip()]
    expected = [path.name for path in (ROOT / "edgetrain").rglob("*.py") if path.name != "__init__.py"]
    expected += [f"{path.parent.name}/" for path in (ROOT / "edgetrain").rglob("__init__.py")]
    assert sorted(listed) == sorted(expected)
