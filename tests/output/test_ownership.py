"""The output package is the one owner of the output folder: no other module spells a name under
`_mmenc/`, and only modules that read inputs or a model list folders."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "mmenc_cli"
OUTPUT = PACKAGE / "output"
#: modules outside output/ that list folders, and why
LISTING_ALLOWED = {
    "readers/": "inputs: folders and globs of manifests, shards, folders of files, datasets",
    "export.py": "the export's destination must be empty",
    "run/model_identity.py": "a local model folder's files, for its content stamp",
}
LISTING = ("glob", "rglob", "iterdir", "scandir", "listdir", "walk")


def modules_outside_output() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if OUTPUT not in p.parents]


def strings(tree: ast.AST) -> list[ast.Constant]:
    """String constants that are not docstrings."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_no_module_outside_output_spells_a_name_under_mmenc() -> None:
    found = [f"{p.relative_to(PACKAGE)}:{n.lineno}" for p in modules_outside_output()
             for n in strings(ast.parse(p.read_text(encoding="utf-8"))) if "_mmenc/" in n.value or n.value == "_mmenc"]
    assert found == [], "names under _mmenc/ belong to output/layout.py: " + ", ".join(found)


def test_only_input_and_model_readers_list_folders() -> None:
    found = []
    for path in modules_outside_output():
        rel = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LISTING \
                    and not any(rel == a or (a.endswith("/") and rel.startswith(a)) for a in LISTING_ALLOWED):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node.func)}")
    assert found == [], "list the output's folders through output/: " + ", ".join(found)


def test_the_checks_find_what_they_look_for() -> None:
    tree = ast.parse('"""a docstring about _mmenc/"""\npath = "OUT/_mmenc/errors"\n')
    assert [n.value for n in strings(tree)] == ["OUT/_mmenc/errors"]
