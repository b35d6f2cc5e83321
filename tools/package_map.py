#!/usr/bin/env python3
"""The picture of the package in docs/layout.md, made from the code: edgetrain/'s folders and modules with
the first line of each one's docstring, and which folder imports which (every import counts: inside
functions and under `if TYPE_CHECKING:` too).

    python tools/package_map.py           # print the picture
    python tools/package_map.py --write   # rewrite it between the markers in docs/layout.md
    python tools/package_map.py --check   # exit 1 when docs/layout.md's picture is not the code's

tests/test_docs.py runs --check, so a move that is not in the picture fails the suite.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "edgetrain"
PAGE = ROOT / "docs" / "layout.md"
BEGIN = "<!-- package map: begin (tools/package_map.py --write) -->"
END = "<!-- package map: end -->"
SUMMARY_WIDTH = 88


def summary(path: Path) -> str:
    """The first line of the module's docstring, cut at its first sentence and to SUMMARY_WIDTH."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    line = doc.strip().split("\n", 1)[0].strip()
    if ". " in line:
        line = line.split(". ", 1)[0] + "."
    return line if len(line) <= SUMMARY_WIDTH else line[:SUMMARY_WIDTH - 3].rstrip() + "..."


def tree_lines(folder: Path, depth: int = 0) -> list[str]:
    lines = []
    indent = "    " * depth
    modules = sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")
    packages = sorted(p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    width = 30 - len(indent)
    for module in modules:
        lines.append(f"{indent}{module.name:<{width}} {summary(module)}".rstrip())
    for package in packages:
        lines.append(f"{indent}{package.name + '/':<{width}} {summary(package / '__init__.py')}".rstrip())
        lines += tree_lines(package, depth + 1)
    return lines


def folder_of(module: str) -> str:
    """edgetrain.training.learner -> training; edgetrain.registry -> registry (a module of the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "edgetrain"


def folder_imports() -> dict[str, set[str]]:
    """folder -> the other folders (and root modules) of edgetrain/ its modules import."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        module = ".".join(parts)
        if module == "edgetrain":
            continue  # the front door imports everything it exports
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        source = folder_of(module)
        edges = graph.setdefault(source, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    prefix = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(prefix + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for name in names:
                if name.startswith("edgetrain.") and folder_of(name) != source:
                    target = folder_of(name)
                    if (PACKAGE / target).is_dir() or (PACKAGE / f"{target}.py").is_file():
                        edges.add(target)
    return graph


def mermaid(graph: dict[str, set[str]]) -> list[str]:
    lines = ["```mermaid", "flowchart LR"]
    for source in sorted(graph):
        for target in sorted(graph[source]):
            lines.append(f"    {source} --> {target}")
    lines.append("```")
    return lines


def picture() -> str:
    graph = folder_imports()
    lines = ["The package, folder by folder (each line: the module's or folder's own first docstring line):", "",
             "```text", "edgetrain/"]
    lines += ["    " + line for line in tree_lines(PACKAGE)]
    lines += ["```", "", "Which folder imports which (an arrow: the first imports the second):", ""]
    lines += mermaid(graph)
    lines += ["", "The same as a list:", ""]
    lines += [f"- `{source}` imports " + (", ".join(f"`{t}`" for t in sorted(graph[source])) or "nothing of edgetrain")
              for source in sorted(graph)]
    return "\n".join(lines) + "\n"


def page_with(text: str, page: str) -> str:
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{PAGE} has no package-map markers ({BEGIN} ... {END})")
    head, _, rest = page.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{text}{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"rewrite the picture in {PAGE.relative_to(ROOT)}")
    group.add_argument("--check", action="store_true", help="exit 1 when the page's picture is not the code's")
    args = parser.parse_args()
    text = picture()
    if not (args.write or args.check):
        sys.stdout.write(text)
        return 0
    page = PAGE.read_text(encoding="utf-8")
    wanted = page_with(text, page)
    if args.write:
        PAGE.write_text(wanted, encoding="utf-8")
        return 0
    if wanted != page:
        print(f"{PAGE.relative_to(ROOT)}'s package map is not the code's: run python tools/package_map.py --write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
