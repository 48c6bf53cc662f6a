"""The package's layout is its architecture: docs/architecture.md's tree lists exactly its
folders and modules, few modules sit at the top, and every folder imports only folders
below it (the order of the tree)."""

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


def test_every_part_imports_only_parts_below_it():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).with_suffix("")
        if relative.parts[0] in ("backends", "benchmarks") or "__pycache__" in relative.parts:
            continue
        module = ".".join(("tiering", *relative.parts))
        part = part_of(module) if len(relative.parts) > 1 or relative.name != "__init__" else "__init__"
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if not name.startswith("tiering.") or name.startswith(("tiering.backends", "tiering.benchmarks")):
                    continue
                target = part_of(name)
                if target != part and FLOORS[target] >= FLOORS[part]:
                    upward.append(f"{module} imports {name}")
    assert upward == []
