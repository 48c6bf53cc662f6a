"""The package's layout is its architecture: docs/architecture.md's tree lists exactly its
folders and modules, few modules sit at the top, every folder imports only folders below it
(the order of the tree), no two modules import each other, no module is too long to read, and
the engine's tests import nothing from the benchmarks."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tiering"
FLOORS = {  # a part may import the parts of lower floors, and itself
    "errors": 0,
    "stats": 0,
    "options": 1,
    "contract": 2,
    "eviction": 3,
    "cpu": 4,
    "tiers": 5,
    "backends": 5.5,  # the built-in tiers (the repository's backends/): over the tier contract, as a third party's
    "engine": 6,
    "worker": 6,
    "config": 7,
    "spec": 8,
    "__init__": 9,
    "integrations": 10,
    "testing": 10,
    "config_check": 11,  # the CLI, over the vLLM adapter's config check too
}


def documented_tree() -> set[str]:
    """The paths under tiering/ that docs/architecture.md's tree names (folders end in /)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```\n(tiering/.*?)```", text, flags=re.S)
    assert block, "docs/architecture.md has no tree starting at tiering/"
    paths, stack = set(), []
    for line in block[1].splitlines()[1:]:
        entry = re.match(r"^( +)(\S+(?:/|\.py))(\s|$)", line)
        if entry is None:
            continue
        depth = len(entry[1]) // 2
        stack[depth - 1 :] = [entry[2]]
        paths.add("".join(stack))
    return paths


def package_tree() -> set[str]:
    paths = set()
    for path in PACKAGE.rglob("*"):
        relative = path.relative_to(PACKAGE)
        if "__pycache__" in relative.parts or relative.parts[0] in ("backends", "benchmarks"):
            continue  # (links a checkout may have for tools that run without installing)
        if path.is_dir():
            paths.add(f"{relative}/")
        elif path.suffix == ".py" and (path.name != "__init__.py" or path.parent == PACKAGE):
            paths.add(str(relative))
    return paths


def test_the_architecture_page_lists_every_folder_and_module_and_no_other():
    documented, present = documented_tree(), package_tree()
    assert documented - present == set(), "listed in docs/architecture.md but not in tiering/"
    assert present - documented == set(), "in tiering/ but not listed in docs/architecture.md"


def test_few_modules_sit_at_the_top_and_every_folder_says_what_it_holds():
    assert len(list(PACKAGE.glob("*.py"))) <= 8
    for init in PACKAGE.glob("*/__init__.py"):
        if init.parent.is_symlink():
            continue  # backends/ or benchmarks/ linked in by a checkout's tooling: not the package's folders
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Thread" in docstring and "Imports:" in docstring, f"{init}: say its threads and what it may import"


def part_of(module: str) -> str:
    """The part (a top-level module, or a folder) of the dotted `module` under tiering."""
    return module.split(".")[1] if module.count(".") else "__init__"


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name, the repository's backends/ as
    ``tiering.backends`` (benchmarks/ left out: they drive the whole package)."""
    modules = {}
    for root, prefix in ((PACKAGE, ("tiering",)), (ROOT / "backends", ("tiering", "backends"))):
        for path in root.rglob("*.py"):
            relative = path.relative_to(root).with_suffix("")
            if relative.parts[0] in ("backends", "benchmarks") or "__pycache__" in relative.parts:
                continue  # (links a checkout may have under tiering/)
            parts = (*prefix, *relative.parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)] = path
    return modules


def test_every_part_imports_only_parts_below_it_and_backends_only_through_the_registry():
    upward = []
    for module, path in package_modules().items():
        part = part_of(module) if path.name != "__init__.py" or path.parent != PACKAGE else "__init__"
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if not name.startswith("tiering.") or name.startswith("tiering.benchmarks"):
                    continue
                target = part_of(name)
                if target == "backends" and part != "backends":
                    upward.append(f"{module} imports {name} (tiers are found through the registry)")
                elif target != part and FLOORS[target] >= FLOORS[part]:
                    upward.append(f"{module} imports {name}")
    assert upward == []


def test_every_backend_folder_says_what_it_holds():
    for init in [ROOT / "backends" / "__init__.py", *(ROOT / "backends").glob("*/__init__.py")]:
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Thread" in docstring, f"{init}: say what it holds and its threads"
        assert init.parent.name == "backends" or "Imports:" in docstring, f"{init}: say what it may import"


MAX_MODULE_LINES = 450


MAX_FUNCTION_LINES = 80


def test_no_function_runs_past_80_lines():
    long = []
    for folder in ("tiering", "backends", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.relative_to(ROOT).parts[:2] in (("tiering", "backends"), ("tiering", "benchmarks")):
                continue  # links a checkout may have (see package_tree)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}: {node.name}, {lines} lines")
    assert long == [], "split these into steps with names"


def test_no_module_runs_past_450_lines():
    long = []
    for folder in ("tiering", "backends", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            relative = path.relative_to(ROOT)
            if relative.parts[:2] in (("tiering", "backends"), ("tiering", "benchmarks")):
                continue  # links a checkout may have (see package_tree)
            lines = len(path.read_text().splitlines())
            if lines > MAX_MODULE_LINES:
                long.append(f"{relative}: {lines} lines")
    assert long == [], "split these along their seams"


def module_imports(path: Path) -> set[str]:
    """The tiering modules `path` imports, at its top or inside its functions (an import in a
    function is a dependency all the same, only a later one), those under
    ``if TYPE_CHECKING:`` left out (a name imported from a package is its submodule when
    there is one)."""
    imported: set[str] = set()
    nodes: list[ast.AST] = [ast.parse(path.read_text())]
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        nodes.extend(ast.iter_child_nodes(node))
    return {name for name in imported if name.startswith("tiering.")}


def test_no_two_modules_import_each_other_directly_or_through_others():
    # a package's re-exports are not its modules' dependencies
    modules = {name: path for name, path in package_modules().items() if path.name != "__init__.py"}
    graph = {name: module_imports(path) & modules.keys() for name, path in modules.items()}
    cycles, state = [], dict.fromkeys(graph, 0)  # 0 unseen, 1 on the path, 2 done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state[target] == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif state[target] == 0:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if state[name] == 0:
            visit(name, [name])
    assert cycles == []


def test_the_engines_tests_import_nothing_from_the_benchmarks():
    """tests/ tests the engine; the benchmarks' and the load generator's tests are in tests_bench/."""
    tests = sorted((ROOT / "tests").glob("*.py"))
    assert tests, "tests/ holds no test modules"
    offenders = {
        path.name: sorted(name for name in module_imports(path) if name.startswith("tiering.benchmarks"))
        for path in tests
    }
    assert {name: imports for name, imports in offenders.items() if imports} == {}
