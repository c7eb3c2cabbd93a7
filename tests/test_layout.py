"""The house rules of the package, checked on its source: small modules, short functions, no
import cycle, and run code that calls encoders only through their declared interface."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mmenc_cli"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_COMMAND_BODY_LINES = 40  # a Typer command spells its options out as parameters; its body stays short


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_command(node: ast.FunctionDef) -> bool:
    """A Typer command: a function in `cli/` whose parameters are annotated with `Annotated[...]` options."""
    return any(isinstance(a.annotation, (ast.Name, ast.Subscript)) and "Annotated" in ast.unparse(a.annotation)
               or ast.unparse(a.annotation or ast.Constant(None)).endswith(("Opt", "Arg"))
               for a in node.args.args)


def body_lines(node: ast.FunctionDef) -> int:
    """Lines after the parameter list and the docstring."""
    body = node.body[1:] if ast.get_docstring(node) else node.body
    return node.end_lineno - body[0].lineno + 1 if body else 0


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_functions_are_small(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    assert len(source.splitlines()) <= MAX_MODULE_LINES
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines <= MAX_FUNCTION_LINES:
                continue
            assert "cli" in path.parts and is_command(node), f"{node.name}: {lines} lines"
            assert body_lines(node) < MAX_COMMAND_BODY_LINES, f"command {node.name}: body of {body_lines(node)} lines"


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a module body, those inside `if TYPE_CHECKING:` blocks included (a cycle
    for the type checker is a cycle of the design)."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out += _module_level(node.body)
        else:
            out.append(node)
    return out


def top_level_imports(path: Path) -> set[str]:
    """The package modules a module imports when it is imported or type-checked (not inside
    functions: a lazy import of a heavy library is no part of the module graph)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _module_level(ast.parse(path.read_text(encoding="utf-8")).body):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("mmenc_cli"):
                continue
            for alias in node.names:  # `from . import http` imports a module, `from .x import f` a name
                sub = f"{base}.{alias.name}"
                found.add(sub if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                          or (PACKAGE.parent / sub.replace(".", "/") / "__init__.py").exists() else base)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mmenc_cli")}
    return found - {name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> modules it imports), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles() -> None:
    graph = {module_name(p): top_level_imports(p) for p in MODULES}
    assert "mmenc_cli.run.counters" in graph["mmenc_cli.run.encode_stage"]  # the graph is read, not empty
    assert "mmenc_cli.media.http" in graph["mmenc_cli.media"]  # `from . import http` is a module import
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_for_the_type_checker_count(tmp_path: Path) -> None:
    module = PACKAGE / "run" / "encode_stage.py"
    body = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .counters import Counters\n").body
    assert [ast.unparse(n) for n in _module_level(body)][-1] == "from .counters import Counters"
    assert "mmenc_cli.run.counters" in top_level_imports(module)


def test_the_cycle_check_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_run_code_never_probes_an_encoder() -> None:
    """The run code uses only what `encoders/base.py` declares: no getattr/hasattr on encoders."""
    for path in sorted((PACKAGE / "run").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and any(word in ast.unparse(node.args[0]) for word in ("enc", "payload"))):
                raise AssertionError(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
