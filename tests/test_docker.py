"""Claims (no Docker engine runs here, so the images are unbuilt): each Dockerfile starts from
vLLM's official image for its platform, copies only paths that exist, installs an extra that
pyproject defines, and runs the project's own console script."""
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASES = {"cuda": "vllm/vllm-openai:", "rocm": "rocm/vllm:"}


@pytest.mark.parametrize("platform", sorted(BASES))
def test_dockerfile_is_consistent_with_the_repo(platform):
    text = (ROOT / "docker" / platform / "Dockerfile").read_text()
    assert re.search(rf"^FROM {re.escape(BASES[platform])}\S+$", text, re.M)
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = re.findall(r'pip install [^\n]*-e "\.\[(\w+)\]"', text)
    assert extras and all(e in meta["project"]["optional-dependencies"] for e in extras)
    assert 'ENTRYPOINT ["vime"]' in text and "vime" in meta["project"]["scripts"]
    cmd = re.search(r"^CMD \[(.+)\]$", text, re.M).group(1)
    recipe = re.search(r'"--config-name", "(\w+)"', cmd).group(1)
    assert (ROOT / "recipes" / f"{recipe}.yaml").exists()
