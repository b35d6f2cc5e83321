"""The suite's own rules: no test that cannot fail.

A test function must check something: an `assert`, a `raise AssertionError(...)`, `pytest.raises` /
`pytest.warns` / `pytest.fail`, an `assert_*` call (numpy, torch.testing, unittest style), or a call to a
helper of the test suite that does
one of those, found through the module's own functions and what it imports from `tests/`. A test that
only runs code passes whatever the code computes, so it guards nothing.
"""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CHECKING_PYTEST_CALLS = {"raises", "warns", "fail", "deprecated_call"}


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _checks_directly(node: ast.AST) -> bool:
    for child in ast.walk(node):
        if isinstance(child, ast.Assert):
            return True
        # A helper that counts a case before it fails (tests/reliability's tally) raises the error itself.
        if isinstance(child, ast.Raise) and child.exc is not None:
            raised = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
            if isinstance(raised, ast.Name) and raised.id == "AssertionError":
                return True
        if isinstance(child, ast.Call):
            func = child.func
            if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "pytest"
                    and func.attr in CHECKING_PYTEST_CALLS):
                return True
            name = _called_name(child)
            if name is not None and name.lstrip("_").startswith("assert"):
                return True
    return False


def _calls(node: ast.AST) -> set[str]:
    return {name for child in ast.walk(node) if isinstance(child, ast.Call) and (name := _called_name(child))}


class _Module:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        self.functions: dict[str, ast.AST] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, node)
        # name used here -> (module file, name there) for `from tests... import name` / `from testkit import`
        self.imported: dict[str, tuple[Path, str]] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                source = _test_module_file(node.module, path)
                if source is not None:
                    for alias in node.names:
                        self.imported[alias.asname or alias.name] = (source, alias.name)

    def tests(self) -> list[ast.FunctionDef]:
        found = []
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                found.append(node)
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                found.extend(item for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                             and item.name.startswith("test"))
        return found


def _test_module_file(dotted: str, importer: Path) -> Path | None:
    parts = dotted.split(".")
    if parts[0] == "tests":
        parts = parts[1:]
    for base in (TESTS, importer.parent):
        candidate = base.joinpath(*parts).with_suffix(".py")
        if candidate.is_file():
            return candidate
    return None


class _Checker:
    """Does a function check something, directly or through the suite's helpers (memoised, cycle-safe)."""

    def __init__(self) -> None:
        self.modules: dict[Path, _Module] = {}
        self.memo: dict[tuple[Path, str], bool] = {}

    def module(self, path: Path) -> _Module:
        if path not in self.modules:
            self.modules[path] = _Module(path)
        return self.modules[path]

    def checks(self, path: Path, name: str) -> bool:
        key = (path, name)
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = False  # a cycle does not count as a check
        module = self.module(path)
        node = module.functions.get(name)
        if node is None:
            if name in module.imported:
                result = self.checks(*module.imported[name])
            else:
                result = False
        elif _checks_directly(node):
            result = True
        else:
            result = any(self._helper_checks(module, callee) for callee in _calls(node))
        self.memo[key] = result
        return result

    def _helper_checks(self, module: _Module, callee: str) -> bool:
        if callee in module.functions or callee in module.imported:
            return self.checks(module.path, callee)
        conftests = [parent / "conftest.py" for parent in module.path.parents if TESTS in (parent, *parent.parents)]
        return any(c.is_file() and callee in self.module(c).functions and self.checks(c, callee) for c in conftests)


def find_tests_that_check_nothing(root: Path = TESTS) -> list[str]:
    checker = _Checker()
    offenders = []
    for path in sorted(root.rglob("test_*.py")):
        module = checker.module(path)
        for test in module.tests():
            if not (_checks_directly(test) or any(checker._helper_checks(module, c) for c in _calls(test))):
                offenders.append(f"{path.relative_to(root.parent)}:{test.lineno} {test.name}")
    return offenders


def test_every_test_function_checks_something():
    offenders = find_tests_that_check_nothing()
    assert not offenders, ("these tests assert nothing, so they cannot fail on a wrong result; add an assert, "
                           "pytest.raises/warns, or call a helper that asserts:\n  " + "\n  ".join(offenders))


def test_the_hygiene_check_finds_a_test_that_checks_nothing(tmp_path):
    (tmp_path / "helpers.py").write_text("def verify(x):\n    assert x\n\ndef run(x):\n    return x\n\n"
                                         "def refuse(x):\n    if x:\n        raise AssertionError(x)\n\n"
                                         "def quiet(x):\n    raise ValueError(x)\n")
    (tmp_path / "test_sample.py").write_text(
        "import pytest\nfrom helpers import verify, run, refuse, quiet\n\n"
        "def test_runs_only():\n    run(1)\n\n"
        "def test_swallows():\n    try:\n        run(1)\n    except Exception:\n        pass\n\n"
        "def test_asserts():\n    assert run(1)\n\n"
        "def test_via_helper():\n    verify(run(1))\n\n"
        "def test_via_raising_helper():\n    refuse(run(0))\n\n"
        "def test_via_other_raise():\n    quiet(run(0))\n\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n\n"
        "def test_numpy_style():\n    np.testing.assert_allclose(1, 1)\n\n"
        "class TestGroup:\n    def test_method_without_check(self):\n        run(2)\n")
    offenders = find_tests_that_check_nothing(tmp_path)
    assert [line.split()[-1] for line in offenders] == ["test_runs_only", "test_swallows", "test_via_other_raise",
                                                        "test_method_without_check"]
