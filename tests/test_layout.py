"""Claim: rlkernel's arrows point down. contracts/ imports only contracts; backends/ imports
contracts, dispatch and backends; ops/ imports backends, contracts, dispatch; parallel/ may use
ops/ (never the reverse); nothing below
imports ops/, parallel/, models/, integrations/ or the package root; dispatch imports only
contracts. Checked on the source (every `from .x import` / `import rlkernel.x`), so a cycle
cannot creep back in."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rlkernel"
# layer -> the layers it may import (besides itself)
ALLOWED = {
    "contracts": set(),
    "dispatch": {"contracts"},
    "backends": {"contracts", "dispatch", "golden"},
    "golden": {"contracts", "dispatch", "backends", "ops", "root"},  # the suite runs the public ops
    "ops": {"contracts", "dispatch", "backends"},
    "parallel": {"contracts", "dispatch", "backends", "ops"},  # tp_backward builds its gradients from the public linear
    "models": {"contracts", "dispatch", "backends", "ops", "parallel"},
    # golden: the engine's worker reports its weights by golden.digest (`vime parity --check-weights` compares them)
    "integrations": {"contracts", "dispatch", "backends", "ops", "parallel", "models", "root", "runtime", "golden"},
    "runtime": set(),
}


def _layer(parts: list[str]) -> str:
    if not parts or parts[0] == "__init__":
        return "root"
    return parts[0].removesuffix(".py")


def _imports(path: Path):
    mod = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    pkg = mod[:-1] if path.name != "__init__.py" else mod[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1] if node.level > 1 else pkg
                target = base + (node.module.split(".") if node.module else [])
                if not node.module:  # from . import a, b
                    for alias in node.names:
                        yield target + [alias.name]
                    continue
                yield target
            elif node.module and node.module.split(".")[0] == "rlkernel":
                yield node.module.split(".")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "rlkernel":
                    yield alias.name.split(".")


def test_rlkernel_layers_only_import_downwards():
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = list(path.relative_to(ROOT).parts)
        if rel == ["__init__.py"]:
            continue
        here = _layer(rel)
        for target in _imports(path):
            if target[0] != "rlkernel":
                continue
            there = _layer(target[1:])
            if there != here and there not in ALLOWED.get(here, set()):
                bad.append(f"{'/'.join(rel)} ({here}) imports {'.'.join(target)} ({there})")
    assert bad == []


def test_code_stamp_follows_the_sources(tmp_path):
    """vime.stamp: the hash that dates a result changes with any measured source, not with other files."""
    from vime.stamp import source_sha256

    for folder in ("vime", "rlkernel", "recipes", "scripts"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.py").write_text("x = 1\n")
    before = source_sha256(tmp_path)
    (tmp_path / "notes.md").write_text("not a source")
    assert source_sha256(tmp_path) == before
    (tmp_path / "rlkernel" / "a.py").write_text("x = 2\n")
    assert source_sha256(tmp_path) != before
