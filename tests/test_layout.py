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


def test_a_recorded_source_hash_names_its_commit(tmp_path):
    """vime.stamp.commit_for_sources: a device record's git commit is stale (the device keeps the first upload's git
    metadata), its source hash is not — the commit whose sources hash to it is found from git's objects alone, the
    newest such one; sources never committed as they were name none."""
    import subprocess

    from vime.stamp import commit_for_sources, main, source_sha256

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    for folder in ("vime", "rlkernel", "recipes", "scripts"):
        (tmp_path / folder / "sub").mkdir(parents=True)
        (tmp_path / folder / "a.py").write_text(f"{folder} = 1\n")
        (tmp_path / folder / "sub" / "b.yaml").write_text("k: 1\n")
        (tmp_path / folder / "sub" / "skip.md").write_text("not a source\n")
    # "sub-x.py" sorts before "sub/b.yaml" as a string ('-' < '/') and after it part by part, as the tree walk does
    (tmp_path / "scripts" / "sub-x.json").write_text("{}\n")
    git("add", "-A")
    git("commit", "-qm", "a")
    a, sha_a = git("rev-parse", "HEAD"), source_sha256(tmp_path)
    (tmp_path / "rlkernel" / "sub" / "b.yaml").write_text("k: 2\n")
    sha_dirty = source_sha256(tmp_path)
    (tmp_path / "rlkernel" / "a.py").write_text("rlkernel = 2\n")
    git("commit", "-qam", "b")
    b, sha_b = git("rev-parse", "HEAD"), source_sha256(tmp_path)
    (tmp_path / "notes.md").write_text("notes only\n")
    git("add", "-A")
    git("commit", "-qm", "notes")
    c = git("rev-parse", "HEAD")
    assert len({sha_a, sha_b, sha_dirty}) == 3
    assert commit_for_sources(sha_a, tmp_path) == a
    assert commit_for_sources(sha_b, tmp_path) == c != b  # the same sources: the newest commit that has them
    assert commit_for_sources(sha_dirty, tmp_path) is None  # a tree that ran but was never committed as it was
    assert commit_for_sources(sha_a, tmp_path, max_commits=2) is None  # a is three commits back
    assert main(["which", sha_a, "--root", str(tmp_path)]) == 0
    assert main(["which", "0" * 64, "--root", str(tmp_path)]) == 1
