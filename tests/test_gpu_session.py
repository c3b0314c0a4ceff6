"""scripts/gpu_session.py, the device calls' step table, on the CPU: every step runs a script that exists, and the GEMM
sweep steps write distinct files (session 12 ran `gemm_table gemm_clusters` in one call; both wrote h200_gemm_sweep.json
and the table's result was lost)."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

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
    """Each sweep step's own argument list through the sweep script (on the CPU it writes {"skipped": ...} under the
    name a GPU run would use): no two steps share a file."""
    import gpu_gemm_sweep

    written = {}
    for name, (_, cmd) in gpu_session.STEPS.items():
        argv = _argv(cmd, tmp_path / name)
        if "scripts/gpu_gemm_sweep.py" not in argv:
            continue
        assert gpu_gemm_sweep.main(argv[argv.index("scripts/gpu_gemm_sweep.py") + 1:]) == 0
        files = [p.name for p in (tmp_path / name).iterdir()]
        assert len(files) == 1, (name, files)
        written[name] = files[0]
    assert {"gemm_sweep", "gemm_table", "gemm_clusters", "gemm_segments", "gemm_swiglu"} <= set(written)
    assert len(set(written.values())) == len(written), written
    assert written["gemm_table"] == "h200_gemm_sweep_table.json" and written["gemm_clusters"] == "h200_gemm_sweep_clusters.json"
