"""The library's imports point one way: no cycle among its modules (imports inside functions counted), and
the ground floor (``errors``, ``layout``, ``device`` and its ``interpreter``) is all that ``tasks/`` and ``scheduler/`` import of
``megakernel/``'s own modules, while it imports none of theirs; no project module is imported inside a
function but the server by the command line (FastAPI is an optional extra)."""
import ast
import importlib
import pkgutil
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

GROUND_FLOOR = {"megakernel.errors", "megakernel.layout", "megakernel.device", "megakernel.interpreter"}
LOWER_PACKAGES = ("megakernel.tasks", "megakernel.scheduler")


def _modules() -> dict[str, str]:
    """Every module of the package: its file, by name (``tasks/``, ``scheduler/``, ``tools/`` are installed as
    subpackages from folders of their own, so each is walked from its own path)."""
    found = {}
    for name in ("megakernel", "megakernel.tasks", "megakernel.scheduler", "megakernel.tools"):
        package = importlib.import_module(name)
        found[name] = package.__file__
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            found[info.name] = info.module_finder.find_spec(info.name).origin
    return found


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(name: str, path: str, modules: dict[str, str], tree: ast.AST | None = None) -> set[str]:
    """The project modules that module ``name`` imports when it runs, in functions too (not under
    TYPE_CHECKING); of ``tree`` only, a part of the module, where given."""
    package = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
    tree = tree or ast.parse(open(path).read())
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block) for n in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                else node.module
            names = {f"{base}.{alias.name}" for alias in node.names}
            found |= names & modules.keys()
            if not names <= modules.keys():  # a name the module (a package's __init__) defines
                found.add(base)
    return {m for m in found if m in modules and m != name}


def test_the_imports_have_no_cycle_and_the_ground_floor_imports_nothing_above_it():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as error:
        raise AssertionError(f"an import cycle: {' -> '.join(error.args[1])}") from None
    for name in sorted(GROUND_FLOOR):
        assert graph[name] <= GROUND_FLOOR, f"{name} imports {sorted(graph[name] - GROUND_FLOOR)}"
    for name, imported in sorted(graph.items()):
        if name.startswith(LOWER_PACKAGES):
            own = {m for m in imported if m.count(".") == 1 and not m.startswith(LOWER_PACKAGES)}
            assert own <= GROUND_FLOOR, f"{name} imports {sorted(own - GROUND_FLOOR)}"


LAZY = {("megakernel.tools.cli", "megakernel.tools.serve")}  # `megakernel --help` without FastAPI


def test_no_project_module_is_imported_inside_a_function_but_the_optional_server():
    modules = _modules()
    inside = set()
    for name, path in modules.items():
        tree = ast.parse(open(path).read())
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = ast.Module(body=function.body, type_ignores=[])
                inside |= {(name, m) for m in _imports(name, path, modules, body)}
    assert inside <= LAZY, sorted(inside - LAZY)


def test_every_package_is_in_the_wheel():
    """``pyproject.toml`` lists the packages a (non-editable) install copies: every package of the tree."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    packages = {name for name, path in _modules().items() if path.endswith("__init__.py")}
    listed = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert packages == set(listed), (sorted(packages - set(listed)), sorted(set(listed) - packages))
