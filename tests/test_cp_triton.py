"""Context parallelism on the GPU path under Triton's interpreter (float32, small sizes: the kernels' index logic):
scripts/check_cp_pieces.py's claims (its docstring). The interpreter's bfloat16 is not the GPU's (its casts and exp2
gave other values for the unchanged attention backward itself), so bfloat16 runs on a GPU: `gpu_session.py cp_pieces`."""
from pathlib import Path

import pytest

pytest.importorskip("triton")

from helpers import run_interpreted  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_cp_pieces.py"


def test_cp_pieces_on_the_triton_kernels():
    out = run_interpreted("import sys; sys.argv = ['check_cp_pieces.py', 'float32']\n" + SCRIPT.read_text())
    assert out.strip().endswith("ok float32"), out
