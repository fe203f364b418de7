"""The layer rule of docs/architecture.md, checked on the source: imports point down only, and within a row only to
the units listed before (LAYERS); no import cycles, counting imports inside functions; nothing at run time imports
the test-fixture builders; files and functions stay small (the exceptions are listed here and in
docs/architecture.md, with the reason), and ruff's formatter decides every layout (no `# fmt: skip`). Each check is
also run on a small broken tree, so it is seen to fail."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "distvideo"

# The rows of docs/architecture.md, bottom first. A unit is a top-level module or package of distvideo (or, where
# named, one module of a package: `cli.arguments`, the flags the bench also builds). A module may import from the
# rows below its own, and within its row from the units listed before its own (and its own unit's other modules,
# acyclically), never from a later unit or a higher row. Imports under `if TYPE_CHECKING:` are annotations only:
# they still must not point to a higher row, but they are free within a row and do not count as cycles.
LAYERS: list[tuple[str, ...]] = [
    # errors first; the typed config before what reads it; media (video files) last
    (
        "errors",
        "envs",
        "machine",
        "devices",
        "logging_utils",
        "slurm",
        "launch",
        "outputs",
        "rpc",
        "paths",
        "images",
        "config",
        "request",
        "config_files",
        "media",
    ),
    ("models", "lora"),
    ("parallel",),
    ("pipelines",),
    ("families",),  # one package per model family, registered on import (distvideo/__init__.py imports them)
    ("engine", "worker"),
    ("executors",),
    # protocols: the structural types of the generator (imports it for types only); batch beside the generator,
    # because VideoGenerator.generate_batch is part of the facade (batch never imports it)
    ("protocols", "batch", "generator"),
    ("cli.arguments", "serving", "bench", "cli"),
    ("testing",),  # fixture builders: nothing at run time imports them
    ("__main__", "__init__"),  # the package facade re-exports the public API
]
ROW = {unit: row for row, units in enumerate(LAYERS, start=1) for unit in units}
ORDER = {unit: i for i, unit in enumerate(unit for units in LAYERS for unit in units)}
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
# (module, function): why it is longer (also in docs/architecture.md)
LONG_FUNCTIONS: dict[tuple[str, str], str] = {}
LONG_FILES: dict[str, str] = {}


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = ("distvideo", *path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def unit(module: str) -> str:
    """The unit of LAYERS a module belongs to: the longest listed name it is, or is inside."""
    name = module.removeprefix("distvideo").removeprefix(".") or "__init__"
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in ROW:
            return ".".join(parts[:n])
    return parts[0]


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(path: Path, module: str, known: dict[str, Path], *, run_time_only: bool) -> set[str]:
    """distvideo modules imported by `module`: every import statement, or (`run_time_only`) those that can run,
    at import time or inside a function, leaving out the `if TYPE_CHECKING:` blocks."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if run_time_only and _type_checking(node):
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
            visit(child)

    visit(ast.parse(path.read_text()))
    # the root package is the public facade, run first by any import of a submodule: not a dependency
    return {name for name in found if name in known and name not in (module, "distvideo")}


def import_graph(package: Path = PACKAGE, *, run_time_only: bool) -> dict[str, set[str]]:
    known = modules(package)
    return {m: imports(p, m, known, run_time_only=run_time_only) for m, p in known.items()}


def units_without_a_row(package: Path = PACKAGE) -> list[str]:
    return sorted({unit(m) for m in modules(package)} - set(ROW))


def upward_imports(package: Path = PACKAGE) -> list[str]:
    return [
        f"{module} (row {ROW[unit(module)]}) imports {target} (row {ROW[unit(target)]})"
        for module, targets in import_graph(package, run_time_only=False).items()
        for target in sorted(targets)
        if ROW[unit(target)] > ROW[unit(module)]
    ]


def out_of_order_imports(package: Path = PACKAGE) -> list[str]:
    """Imports within one row from a unit listed after the importer's (LAYERS)."""
    return [
        f"{module} imports {target}: within row {ROW[unit(module)]}, {unit(target)!r} comes after {unit(module)!r}"
        for module, targets in import_graph(package, run_time_only=True).items()
        for target in sorted(targets)
        if ROW[unit(target)] == ROW[unit(module)] and ORDER[unit(target)] > ORDER[unit(module)]
    ]


def import_cycles(package: Path = PACKAGE) -> list[str]:
    graph = import_graph(package, run_time_only=True)
    cycles: list[str] = []
    state: dict[str, str] = {}

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
    return cycles


def formatter_escapes(package: Path = PACKAGE) -> list[str]:
    """Comments that take code away from ruff's formatter (`# fmt: skip`, `# fmt: off`)."""
    found = []
    for module, path in modules(package).items():
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            text = token.string.replace(" ", "")
            if token.type == tokenize.COMMENT and ("fmt:skip" in text or "fmt:off" in text):
                found.append(f"{module}:{token.start[0]}: {token.string}")
    return found


def test_every_module_has_a_row():
    assert units_without_a_row() == []


def test_imports_point_down_only():
    assert upward_imports() == []


def test_imports_within_a_row_follow_its_order():
    assert out_of_order_imports() == []


def test_no_import_cycles():
    assert import_cycles() == []


def test_the_formatter_decides_every_layout():
    """No `# fmt: skip` or `# fmt: off` in src: a file meets the line cap by being split, not by packed lines."""
    assert formatter_escapes() == []


def test_the_checks_see_a_broken_tree(tmp_path):
    """Each check on a tree with one fault of its kind: an upward import, a within-row import against the order, a
    cycle made only of imports inside functions (that also breaks the order), a `# fmt: skip`, a module of no row."""
    files = {
        "errors.py": "def f():\n    from distvideo import config\n",
        "config.py": "from distvideo.errors import ConfigError\n\nX = [1, 2]  # fmt: skip\n",
        "models/__init__.py": "",
        "models/registry.py": "def f():\n    from distvideo.worker import Worker\n",
        "worker.py": "from distvideo.engine import ResolvedEngine\n",
        "engine.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from distvideo.worker import Worker\n",
        "stray.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert units_without_a_row(tmp_path) == ["stray"]
    assert upward_imports(tmp_path) == ["distvideo.models.registry (row 2) imports distvideo.worker (row 6)"]
    assert out_of_order_imports(tmp_path) == [
        "distvideo.errors imports distvideo.config: within row 1, 'config' comes after 'errors'"
    ]  # engine -> worker, for types only, is free
    assert import_cycles(tmp_path) == ["distvideo.config -> distvideo.errors -> distvideo.config"]
    assert formatter_escapes(tmp_path) == ["distvideo.config:3: # fmt: skip"]


def test_nothing_at_run_time_imports_the_fixture_builders():
    offenders = [
        module
        for module, targets in import_graph(run_time_only=False).items()
        if unit(module) != "testing" and any(unit(t) == "testing" for t in targets)
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


def test_listed_exceptions_are_still_needed():
    """An exception that no longer applies is removed from the list (and from docs/architecture.md)."""
    short = [name for name in LONG_FILES if len(modules()[name].read_text().splitlines()) <= MAX_FILE_LINES]
    assert short == []


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
    seams = {m: p for m, p in modules().items() if unit(m) in SEAM_PACKAGES or m == "distvideo.worker"}
    assert len({unit(m) for m in seams}) == len(SEAM_PACKAGES) + 1  # every package found: the check looks somewhere
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
