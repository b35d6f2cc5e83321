"""Names a package exports but imports on first use (PEP 562): `import edgetrain` stays cheap (no torch
for `edgetrain --help`), and a package's light parts load without its heavy ones."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, names: dict[str, str], namespace: dict[str, Any],
                 submodules: bool = False) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: each name of `names` (name -> the module that defines it) is
    imported when first read and kept in `namespace` (the package's globals); with `submodules`, any other
    name is tried as a subpackage (`edgetrain.data` after a plain `import edgetrain`)."""

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
            namespace[name] = value
            return value
        if submodules:
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
