"""scripts/gpu_session.py, the device calls' step table, on the CPU: every step runs a script that exists, and the GEMM
sweep steps write distinct files (session 12 ran `gemm_table gemm_clusters` in one call; both wrote h200_gemm_sweep.json
and the table's result was lost)."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_session  # noqa: E402


def _argv(cmd: str, out: Path) -> list[str]:
    return shlex.split(cmd.split(">", 1)[0].format(out=str(out)))


def test_every_step_runs_a_script_that_exists():
    for name, (seconds, cmd) in gpu_session.STEPS.items():
        assert 0 < seconds <= 600, (name, seconds)  # a device call runs at most 600 s
        scripts = [a for a in _argv(cmd, Path("/o")) if a.startswith("scripts/")]
        for s in scripts:
            assert (ROOT / s).is_file(), (name, s)


def test_the_gemm_sweep_steps_write_distinct_files(tmp_path, capsys):
    """Each sweep's own argument list through the sweep script (on the CPU it writes {"skipped": ...} under the name a
    GPU run would use; a step may chain sweeps with &&): no two sweeps, in one step or two, share a file."""
    import gpu_gemm_sweep

    written = {}
    for name, (_, cmd) in gpu_session.STEPS.items():
        sweeps = [a for a in (_argv(part, tmp_path / name) for part in cmd.split("&&"))
                  if "scripts/gpu_gemm_sweep.py" in a]
        for argv in sweeps:
            assert gpu_gemm_sweep.main(argv[argv.index("scripts/gpu_gemm_sweep.py") + 1:]) == 0
        if sweeps:
            written[name] = sorted(p.name for p in (tmp_path / name).iterdir())
            assert len(written[name]) == len(sweeps), (name, written[name])
    assert {"gemm_sweep", "gemm_table", "gemm_clusters", "gemm_segments", "gemm_swiglu", "gemm_fixup",
            "gemm_qkv_k2"} <= set(written)
    files = [f for fs in written.values() for f in fs]
    assert len(set(files)) == len(files), written
    assert written["gemm_table"] == ["h200_gemm_sweep_table.json"]
    assert written["gemm_clusters"] == ["h200_gemm_sweep_clusters.json"]
    assert written["gemm_fixup"] == ["h200_gemm_sweep_segments4_fixup.json"] and len(written["gemm_qkv_k2"]) == 2


def test_the_sweep_names_a_schedule_in_its_default_file(tmp_path):
    """--schedule other than registers gets its own default file (a fixup sweep never overwrites the registers one);
    --schedule without segments is refused."""
    import gpu_gemm_sweep
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the sweeps would run")
    for extra, want in (([], "h200_gemm_sweep_segments4.json"),
                        (["--schedule", "fixup"], "h200_gemm_sweep_segments4_fixup.json")):
        out = tmp_path / want
        assert gpu_gemm_sweep.main(["--segments", "4", *extra, "--out", str(out)]) == 0
        assert [p.name for p in out.iterdir()] == [want]
    with pytest.raises(SystemExit):
        gpu_gemm_sweep.main(["--schedule", "fixup", "--out", str(tmp_path / "x")])


def test_the_fusion_check_refuses_an_unknown_case_group(tmp_path):
    """gpu_fusion_check.py --only names its case groups (gemm_tail_rows, session 18's step, among them); a misspelt one is
    refused before any work, with the known names, instead of running nothing."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_fusion_check.py"
    bad = subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--only", "gemm_tail_rowz"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "gemm_tail_rowz" in bad.stderr and "gemm_tail_rows" in bad.stderr
    assert not list(tmp_path.iterdir())


def test_every_attention_variant_a_step_names_exists():
    """The variants the attention steps name (`--variants`, `--ab-variants`) are gpu_gluon_attn's: a misspelt one would
    cost a device call (session 39 renamed a variant's stages inside the variant table). The same parse finds a
    misspelt name in a made-up step."""
    import re

    import gpu_gluon_attn as GA

    def named(steps):
        out = set()
        for name, (_, cmd) in steps.items():
            for m in re.finditer(r"--(?:ab-)?variants (\S+)", cmd):
                out |= {(name, v) for v in m.group(1).split(",")}
        return out

    found = named(gpu_session.STEPS)
    assert {v for _, v in found} >= {"production", "qreg", "diag_no_softmax"}  # the parse finds them
    assert not [(s, v) for s, v in found if v not in GA.VARIANTS]
    made_up = named({"x": (60, "python3 scripts/gpu_gluon_attn.py --ab 3 --ab-variants qreg,qerg")})
    assert [(s, v) for s, v in made_up if v not in GA.VARIANTS] == [("x", "qerg")]
