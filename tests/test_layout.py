"""The code's shape, as the codebase issue set it: no import cycle inside ``dartree`` (type-checking
imports included), no function longer than 100 lines, and nothing in ``train/`` importing ``bench/``."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "dartree"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Modules of ``dartree`` that ``name`` imports (a package's imports of its own children left out:
    a package's ``__init__`` gathering its modules is not a cycle)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else [])) if node.level \
                else (node.module or "")
            found |= {c for c in [base] + [f"{base}.{a.name}" for a in node.names] if c in mods}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in mods}
    return {m for m in found if m != name and not m.startswith(name + ".") and m != "dartree"}


def test_no_import_cycle():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            assert state.get(t) != 1, "import cycle: " + " -> ".join(path[path.index(t):] + [t]) if t in path else t
            if t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_no_function_longer_than_100_lines():
    long = [f"{p.relative_to(ROOT.parent)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p in ROOT.rglob("*.py") for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 100]
    assert not long, long


def test_training_does_not_import_the_benchmark():
    mods = _modules()
    for name, path in mods.items():
        if name.startswith("dartree.train"):
            assert not any(m.startswith("dartree.bench") for m in _imports(name, path, mods)), name
