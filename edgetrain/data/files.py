"""Which local files a text stream reads: named files as they are, directories searched for text and JSONL."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from edgetrain.registry import EdgetrainError

DIRECTORY_PATTERNS = ("*.txt", "*.jsonl")  # what a directory contributes; a named file is read whatever its suffix


def is_jsonl(path: Path) -> bool:
    """A JSON Lines file, by its suffix: one JSON record a line (edgetrain.data.jsonl)."""
    return path.suffix.lower() == ".jsonl"


def find_text_files(paths: Sequence[str | Path] | str | Path) -> list[Path]:
    """The files named in `paths`, with each directory replaced by its *.txt and *.jsonl files (recursively,
    sorted by path)."""
    if isinstance(paths, (str, Path)):  # a lone path would otherwise be iterated character by character
        paths = [paths]
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = {p for pattern in DIRECTORY_PATTERNS for p in path.rglob(pattern) if p.is_file()}
            files.extend(sorted(found))
        elif path.is_file():
            files.append(path)
        else:
            raise EdgetrainError(f"text source {path} does not exist")
    if not files:
        raise EdgetrainError(f"no text files (*.txt, *.jsonl) found in {', '.join(map(str, paths)) or '(no paths)'}")
    return files


def describe_files(files: Sequence[Path]) -> str:
    """The first few file names, for messages."""
    shown = ", ".join(map(str, files[:5]))
    return shown + (f" and {len(files) - 5} more files" if len(files) > 5 else "")
