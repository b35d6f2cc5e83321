"""The package's shape: no import cycle inside edgetrain/, counting imports made inside functions and
type-only imports too (a lazy import only hides a cycle until the redesign moves the code around it, and a
module that needs another's type to describe its own functions depends on it); no branching on a backend,
framework or probe by name outside the registries that define them."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "edgetrain"


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _nearest_module(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its code, `if TYPE_CHECKING:` blocks included.
    `from a.b import c` counts as an import of a.b, and of a.b.c when that is a module (as
    ../shared/tools/import_circles.py counts). Importing a module also runs its parent packages' __init__;
    those edges are left out, or every module would be in one cycle with edgetrain/__init__.py."""
    modules = _modules(package)
    root = package.name
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        pending = [ast.parse(path.read_text(), str(path))]
        while pending:
            for node in ast.iter_child_nodes(pending.pop()):
                targets: list[str] = []
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                        base = ".".join(parts + ([base] if base else []))
                    targets = [base] + [f"{base}.{alias.name}" for alias in node.names
                                        if f"{base}.{alias.name}" in modules]
                for target in targets:
                    resolved = _nearest_module(target, modules) if target.split(".")[0] == root else None
                    # A module's own parent packages run before it anyway (see above).
                    if resolved and resolved != name and not name.startswith(resolved + "."):
                        graph[name].add(resolved)
                pending.append(node)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycle_inside_edgetrain_even_through_imports_inside_functions():
    graph = import_graph()
    assert "edgetrain.training.learner" in graph and "edgetrain.methods.base" in graph["edgetrain.training.learner"]
    cycles = import_cycles(graph)
    assert cycles == [], "import cycles (each line: modules that import each other, directly or not):\n" + \
        "\n".join(", ".join(cycle) for cycle in cycles)


def test_methods_never_import_distributed():
    # A method is what one process runs; the multi-process programs (edgetrain/recipes/) and the mechanisms
    # they run on (edgetrain/distributed/) build on the methods, never the other way round (subnet_dp's masks
    # and simulation live in methods/subnet_dp/).
    graph = import_graph()
    offenders = sorted(f"{module} imports {target}" for module, targets in graph.items()
                       if module.startswith("edgetrain.methods") for target in targets
                       if target.startswith("edgetrain.distributed"))
    assert offenders == [], "\n".join(offenders)


def test_methods_never_import_recipes_and_mechanisms_never_import_programs():
    # Recipes (edgetrain/recipes/) are programs over the methods; the distributed mechanisms they run on
    # (launching torchrun, transport) know no recipe.
    graph = import_graph()
    offenders = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                       if (module.startswith("edgetrain.methods") or module.startswith("edgetrain.distributed"))
                       and target.startswith("edgetrain.recipes"))
    assert offenders == [], "\n".join(offenders)


def test_a_type_only_import_closes_a_cycle(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "learner.py").write_text("from pkg.guard import guard_step\n")
    (package / "guard.py").write_text("from typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from pkg.learner import Learner\n")
    assert import_cycles(import_graph(package)) == [["pkg.guard", "pkg.learner"]]


def test_the_cycle_finder_finds_a_cycle_through_three_modules_and_ignores_a_chain():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# Where backends, frameworks and probes are defined and registered: the only code that may name them.
REGISTRY_CODE = ("edgetrain/backends/", "edgetrain/probes/")


def _dispatch_names() -> set[str]:
    from edgetrain.backends import BACKENDS
    from edgetrain.backends.base import BACKEND_ALIASES
    from edgetrain.probes import PROBES

    entries = [BACKENDS.get(name) for name in BACKENDS.names()]
    # "cuda" is a probe and also a torch device type: `tensor.device.type == "cuda"` asks torch, not a registry.
    torch_device_types = {"cpu", "cuda", "mps", "meta"}
    return ({entry.name for entry in entries} | {entry.framework for entry in entries} | set(BACKEND_ALIASES)
            | (set(PROBES.names()) - torch_device_types))


def string_dispatch(path: Path, names: set[str]) -> list[str]:
    """`x == "mlx"`, `framework != "torch"`, `name in ("linux", ...)` and dict literals keyed by such names:
    code that branches on a backend, framework or probe by name instead of asking its registry entry."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        constants: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                constants.extend(operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand])
        elif isinstance(node, ast.Dict):
            constants = [key for key in node.keys if key is not None]
        hits = [c.value for c in constants if isinstance(c, ast.Constant) and c.value in names]
        if hits:
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_no_dispatch_on_backend_framework_or_probe_names_outside_the_registries():
    names = _dispatch_names()
    assert {"torch-cpu", "mlx", "torch", "linux"} <= names
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py"))
                 if not path.relative_to(PACKAGE.parent).as_posix().startswith(REGISTRY_CODE)
                 for hit in string_dispatch(path, names)]
    assert offenders == [], "ask the registry entry (Backend fields, probe methods) instead:\n" + "\n".join(offenders)


def test_every_folder_of_code_is_a_package():
    # setuptools' find_packages skips a folder without __init__.py: its modules would be missing from the
    # wheel though they import fine from a checkout (edgetrain/profiler/ once was such a folder).
    folders = {path.parent for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}
    assert sorted(str(f.relative_to(PACKAGE.parent)) for f in folders if not (f / "__init__.py").is_file()) == []


# Parts that work on another part's object through a Protocol of its public surface: module -> (the name
# the object goes by in its code, the protocols that name what it may use, the class that must offer it).
SURFACES = {
    "training/budget_guard.py": ("learner", ("GuardedLearner",), "edgetrain.training.learner:Learner"),
    "training/fit_loop.py": ("learner", ("FittedLearner",), "edgetrain.training.learner:Learner"),
    "personalise/runner.py": ("owner", ("RunOwner", "WindowOwner"), "edgetrain.personalise.personaliser:Personaliser"),
    "personalise/window.py": ("owner", ("WindowOwner",), "edgetrain.personalise.personaliser:Personaliser"),
}


def _attributes_used_on(tree: ast.AST, name: str) -> set[str]:
    """`x.attr` where x is the variable `name` or `self.name` (the object kept on the part's own instance)."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            value = node.value
            if (isinstance(value, ast.Name) and value.id == name) or (
                    isinstance(value, ast.Attribute) and value.attr == name
                    and isinstance(value.value, ast.Name) and value.value.id == "self"):
                used.add(node.attr)
    return used


def _protocol_members(path: Path, protocols: tuple[str, ...]) -> set[str]:
    members = set()
    # RunOwner extends WindowOwner, which window.py defines.
    for module in {path, PACKAGE / "personalise" / "window.py"}:
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ClassDef) and node.name in protocols:
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        members.add(item.target.id)
                    elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        members.add(item.name)
    return members


def test_parts_use_their_owner_only_through_its_public_protocol():
    # The budget guard and the fit loop once called the learner's private methods, and the personaliser's
    # runner and windows its _require_model: a part that reaches into another's privates is still inside
    # it, whatever file it is in.
    import importlib

    for relative, (name, protocols, owner) in SURFACES.items():
        path = PACKAGE / relative
        used = _attributes_used_on(ast.parse(path.read_text()), name)
        members = _protocol_members(path, protocols)
        assert members, f"{relative}: no protocol {protocols}"
        assert not {a for a in used if a.startswith("_")}, f"{relative} uses private members of its {name}"
        assert used <= members, f"{relative} uses {sorted(used - members)} of its {name}, not in {protocols}"
        module_name, _, class_name = owner.partition(":")
        offered = set(dir(getattr(importlib.import_module(module_name), class_name))) | _instance_attributes(owner)
        assert members <= offered, f"{owner} does not offer {sorted(members - offered)} of {protocols}"


def _instance_attributes(owner: str) -> set[str]:
    """The attributes the owner's __init__ assigns on self (members a Protocol may name as data)."""
    module_name, _, class_name = owner.partition(":")
    path = PACKAGE.parent / (module_name.replace(".", "/") + ".py")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {target.attr for item in ast.walk(node) if isinstance(item, (ast.Assign, ast.AnnAssign))
                    for target in (item.targets if isinstance(item, ast.Assign) else [item.target])
                    for target in (target.elts if isinstance(target, ast.Tuple) else [target])
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    and target.value.id == "self"}
    return set()
