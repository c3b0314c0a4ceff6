"""scripts/gpu_attn_seg.py (session 42: the attention contract's split size as the prefill's lever) on a CPU machine:
its variants are the library's launch knobs, an unknown one is refused by name, and without CUDA it writes a
"skipped" record and exits 0 (the GPU run: benchmarks/H100_session42)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_attn_seg as S  # noqa: E402


def test_variants_are_the_librarys_launch_knobs():
    import inspect

    from rlkernel.backends.triton import attention_gluon as AG

    params = inspect.signature(AG.launch).parameters
    for name, kw in S.VARIANTS.items():
        assert set(kw) <= set(params), (name, kw)
        assert kw["consumers"] in (2, 3)
        if kw["consumers"] == 3:  # the three-consumer kernel refuses the two-consumer kernel's knobs
            AG._three_knobs(AG.STAGES, kw.get("diag", 0), 0, AG.QREG, AG.QK_FIRST)


def test_unknown_variant_is_refused_and_no_cuda_is_a_skip(tmp_path, capsys):
    with pytest.raises(SystemExit):
        S.main(["--out", str(tmp_path), "--variants", "two,nope"])
    assert "unknown variant 'nope'" in capsys.readouterr().err
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real thing")
    assert S.main(["--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "h200_attn_seg.json").read_text()) == {"skipped": "no CUDA device"}
