"""The layer rule of docs/architecture.md, checked on the source: imports point down only, no import cycles, nothing at
run time imports the test-fixture builders, and files and functions stay small (the exceptions are listed here and
in docs/architecture.md, with the reason)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "distvideo"

# row of each top-level module or package: a module may import from its own row and the rows below it
ROWS = {
    "__main__": 11,
    "__init__": 11,  # the package facade re-exports the public API
    "testing": 10,  # fixture builders: nothing at run time imports them
    "cli": 9,
    "serving": 9,
    "bench": 9,
    "batch": 7,  # beside the generator: VideoGenerator.generate_batch is part of the facade; batch never imports it
    "generator": 7,
    "protocols": 7,  # structural types of the generator for batch/, serving/ and bench/ (imports it for types only)
    "executors": 6,
    "worker": 5,
    "engine": 5,
    "pipelines": 4,
    "parallel": 3,
    "models": 2,
    "lora": 2,
    "launch": 1,
    "slurm": 1,
    "envs": 1,
    "config": 1,
    "media": 1,
    "errors": 1,
    "outputs": 1,
    "devices": 1,
    "logging_utils": 1,
}
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
# (module, function): why it is longer (also in docs/architecture.md)
LONG_FUNCTIONS: dict[tuple[str, str], str] = {}
LONG_FILES: dict[str, str] = {
    "distvideo.testing.checkpoints": "one builder and the configurations of every test checkpoint; test code",
}


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("distvideo", *path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(path: Path, module: str, *, top_level_only: bool) -> set[str]:
    """distvideo modules imported by `module` (every import statement, or only those run at import time)."""
    tree = ast.parse(path.read_text())
    known = modules()
    found: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        if top_level_only and (_type_checking(node) or in_function):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("distvideo"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.startswith("distvideo"):
                for alias in node.names:  # `from pkg import submodule` imports the submodule, else pkg itself
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    # the root package is the public facade, run first by any import of a submodule: not a dependency
    return {name for name in found if name in known and name not in (module, "distvideo")}


def test_every_module_has_a_row():
    assert {top(m) for m in modules()} <= set(ROWS), sorted({top(m) for m in modules()} - set(ROWS))


def test_imports_point_down_only():
    upward = []
    for module, path in modules().items():
        for target in imports(path, module, top_level_only=False):
            if ROWS[top(target)] > ROWS[top(module)]:
                upward.append(f"{module} (row {ROWS[top(module)]}) imports {target} (row {ROWS[top(target)]})")
    assert upward == []


def test_no_import_cycles():
    graph = {m: imports(p, m, top_level_only=True) for m, p in modules().items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in state:
                visit(target, [*stack, target])
        state[node] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_nothing_at_run_time_imports_the_fixture_builders():
    offenders = [
        module
        for module, path in modules().items()
        if top(module) != "testing" and any(top(t) == "testing" for t in imports(path, module, top_level_only=False))
    ]
    assert offenders == []


def test_files_are_small():
    long = {
        module: n
        for module, path in modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES and module not in LONG_FILES
    }
    assert long == {}


def test_functions_are_small():
    long = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES and (module, node.name) not in LONG_FUNCTIONS:
                    long.append(f"{module}.{node.name}: {n} lines")
    assert long == []


@pytest.mark.parametrize("name", sorted(LONG_FILES))
def test_listed_exceptions_are_still_needed(name):
    """An exception that no longer applies is removed from the list (and from docs/architecture.md)."""
    assert len(modules()[name].read_text().splitlines()) > MAX_FILE_LINES


# The seams between the generator and what uses it (issue 27): the generator (`gen`: distvideo.protocols), a batch
# item's outcome (`outcome`, `on_item`: ItemOutcome) and a forward's result (`execute_forward`: WorkerOutput) are
# typed, in these packages and in worker.py; an `Any` there would hide them from mypy again.
SEAM_PACKAGES = ("executors", "parallel", "batch", "serving", "bench")
SEAM_NAMES = {"gen", "outcome", "on_item"}


def _says_any(annotation: ast.expr | None) -> bool:
    """No annotation, or one that mentions Any (as `Any`, `typing.Any` or inside a string)."""
    if annotation is None:
        return True
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return any(
        (isinstance(n, ast.Name) and n.id == "Any") or (isinstance(n, ast.Attribute) and n.attr == "Any")
        for n in ast.walk(annotation)
    )


def untyped_seams(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            found += [
                f"{node.name}({p.arg}) line {node.lineno}"
                for p in params
                if p.arg in SEAM_NAMES and _says_any(p.annotation)
            ]
            if node.name == "execute_forward" and _says_any(node.returns):
                found.append(f"execute_forward -> Any, line {node.lineno}")
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in SEAM_NAMES:
            if _says_any(node.annotation):
                found.append(f"{node.target.id}: Any, line {node.lineno}")
    return found


def test_the_generator_seams_are_typed():
    seams = {m: p for m, p in modules().items() if top(m) in SEAM_PACKAGES or m == "distvideo.worker"}
    assert len({top(m) for m in seams}) == len(SEAM_PACKAGES) + 1  # every package found: the check looks somewhere
    untyped = {m: found for m, p in seams.items() if (found := untyped_seams(p.read_text()))}
    assert untyped == {}


def test_the_seam_check_sees_an_any():
    source = (
        "from typing import Any\n"
        "import typing\n"
        "def run_batch(gen: Any, plan): ...\n"
        "def on_item(outcome: 'typing.Any') -> None: ...\n"
        "def execute_batch(shares, on_item: Callable[[Any], None]): ...\n"
        "class Note:\n    outcome: Any\n"
        "class E:\n    def execute_forward(self, request) -> Any: ...\n"
        "def follow(gen, channel): ...\n"
        "def fine(gen: GeneratorHandle, outcome: ItemOutcome) -> WorkerOutput: ...\n"
    )
    assert untyped_seams(source) == [
        "run_batch(gen) line 3",
        "on_item(outcome) line 4",
        "execute_batch(on_item) line 5",
        "follow(gen) line 10",
        "outcome: Any, line 7",
        "execute_forward -> Any, line 9",
    ]


def _store_constructions(tree: ast.AST) -> list[int]:
    """Lines that construct a torch.distributed TCPStore (``TCPStore(...)``, ``dist.TCPStore(...)``)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) == "TCPStore" or getattr(node.func, "id", None) == "TCPStore")
    ]


def test_one_store_channel():
    """Every connection to the rendezvous store is made by `executors.store.connect` (one naming rule, one timeout
    policy): no other module builds a TCPStore client of its own."""
    found = {
        name: lines
        for name, path in modules().items()
        if name != "distvideo.executors.store" and (lines := _store_constructions(ast.parse(path.read_text())))
    }
    assert found == {}, f"TCPStore built outside executors/store.py (use executors.store.connect): {found}"
    assert _store_constructions(ast.parse((PACKAGE / "executors" / "store.py").read_text())), "the check sees none"
    assert _store_constructions(ast.parse("import torch.distributed as dist\ndist.TCPStore('h', 1)")) == [2]
