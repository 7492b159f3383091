"""The package's imports flow one way: io → models → {train, decode} → pipeline (see specdraft/__init__.py).

Parsed, not imported, so a lazy import inside a function counts like a top-level one. Two kinds of import are
not dependencies and are skipped: `if TYPE_CHECKING:` blocks (annotations only) and a file's
`if __name__ == "__main__":` block (train/distill.py starts the pipeline when run as a file).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# layer → the folder its modules live in (the package maps train/ and decode/ into specdraft)
FOLDERS = {"io": REPO / "specdraft" / "io", "models": REPO / "specdraft" / "models", "train": REPO / "train",
           "decode": REPO / "decode"}
ALLOWED = {"io": {"io"}, "models": {"io", "models"}, "train": {"io", "models", "train"},
           "decode": {"io", "models", "decode"}}


def skipped(node: ast.AST) -> bool:
    """An `if TYPE_CHECKING:` or `if __name__ == "__main__":` block."""
    if not isinstance(node, ast.If):
        return False
    source = ast.unparse(node.test)
    return "TYPE_CHECKING" in source or "__main__" in source


def specdraft_imports(tree: ast.AST) -> list[str]:
    """Every `specdraft.X` module this tree imports (from ... import and import ...), outside skipped blocks."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if skipped(node):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return [name for name in found if name == "specdraft" or name.startswith("specdraft.")]


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS else ("pipeline" if parts[1:2] == ["pipeline"] else None)


def test_layers_import_only_from_below():
    broken = []
    for layer, folder in FOLDERS.items():
        files = sorted(folder.glob("*.py"))
        assert files, folder
        for path in files:
            for module in specdraft_imports(ast.parse(path.read_text())):
                used = layer_of(module)
                if used is not None and used not in ALLOWED[layer]:
                    broken.append(f"{path.relative_to(REPO)} ({layer}) imports {module} ({used})")
    assert not broken, "imports against the layering:\n" + "\n".join(broken)


def test_no_generic_top_level_imports():
    """Nothing imports the old top-level names `train` / `decode` (the package is the only import name)."""
    offenders = []
    for path in [*REPO.glob("specdraft/**/*.py"), *REPO.glob("train/*.py"), *REPO.glob("decode/*.py"),
                 *REPO.glob("tests/*.py"), *REPO.glob("scripts/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in ("train", "decode")]
    assert not offenders, offenders


def test_negative_control_catches_a_wrong_way_import():
    """The parser sees lazy imports and skips only the two exempt blocks."""
    tree = ast.parse("def f():\n    from specdraft.decode.bench import run_bench\n"
                     "if TYPE_CHECKING:\n    from specdraft.pipeline import X\n"
                     "if __name__ == '__main__':\n    import specdraft.pipeline\n")
    assert specdraft_imports(tree) == ["specdraft.decode.bench"]
    assert layer_of("specdraft.decode.bench") not in ALLOWED["train"]


def test_test_modules_share_helpers_not_each_other():
    """Shared test code lives in tests/helpers.py (and conftest fixtures): no test module imports another."""
    offenders = []
    for path in REPO.glob("tests/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."):
                if node.module != "tests.helpers":
                    offenders.append(f"{path.name}: from {node.module} import ...")
    assert not offenders, offenders


def test_no_drafter_mode_string_is_compared_outside_the_registry():
    """Drafter kinds are looked up in specdraft/models/registry.py; no `mode == "eagle3"` elsewhere."""
    from specdraft.models.registry import KINDS

    offenders = []
    for path in [*REPO.glob("specdraft/**/*.py"), *REPO.glob("train/*.py"), *REPO.glob("decode/*.py"),
                 *REPO.glob("scripts/*.py")]:
        if path.name == "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in KINDS]
                offenders += [f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}" for _ in constants[:1]]
    assert not offenders, offenders
