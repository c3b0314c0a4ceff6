"""Claims (vime.checkpoint, no run needed):
1. Trainer state survives safetensors + JSON exactly: an AdamW optimizer restored from a checkpoint
   and a Python/NumPy/torch RNG restored from it continue bit for bit like the originals (negative
   control: a fresh optimizer does not), and a type the format cannot hold is refused by path.
2. Saving a step that already exists replaces it whole and leaves no temporary or old directory.
3. A resume cuts only what it recomputes: metric lines, records and provenance of steps >= the
   checkpoint's, plus a torn last line; a corrupt line before it stops the resume, naming it.
4. Sample seeds depend on (seed, step, index) only and fit an int64."""
import json
import random

import numpy as np
import pytest
import torch

from vime import checkpoint as ck

IDENTITY = {"config_sha256": "0" * 64, "dtype": "float32", "path": "m", "config": {}}


def _model_and_opt(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), foreach=False)


def _step(model, opt, x):
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()


def _draws():
    return torch.rand(3).tolist(), random.random(), np.random.random()


def test_optimizer_and_rng_continue_bit_for_bit(tmp_path):
    model, opt = _model_and_opt()
    x = torch.randn(32, 8)
    for _ in range(3):
        _step(model, opt, x)
    np.random.seed(7)
    random.seed(7)
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"optimizer": opt.state_dict(), "weight_version": 3,
             "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                     "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}}
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ck.save(tmp_path, 3, 3, weights, state, IDENTITY, {"run": {"seed": 1}})
    expected = _draws()
    _step(model, opt, x)
    want = {k: v.clone() for k, v in model.state_dict().items()}

    got = ck.resume_point(tmp_path, IDENTITY, {"run": {"seed": 1}})
    assert (got.step, got.weight_version, got.config_changes) == (3, 3, [])
    rng = got.trainer_state["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    n, k, p, h, g = rng["numpy"]
    np.random.set_state((n, k.numpy().astype(np.uint32), p, h, g))
    assert _draws() == expected
    from safetensors.torch import load_file

    model2, opt2 = _model_and_opt(seed=1)
    model2.load_state_dict(load_file(str(got.weights)))
    opt2.load_state_dict(got.trainer_state["optimizer"])
    _step(model2, opt2, x)
    assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())
    model3, opt3 = _model_and_opt(seed=1)  # control: the weights without the optimizer state step elsewhere
    model3.load_state_dict(load_file(str(got.weights)))
    _step(model3, opt3, x)
    assert not all(torch.equal(want[k], v) for k, v in model3.state_dict().items())


def test_state_outside_the_format_is_refused():
    with pytest.raises(TypeError, match=r"state.rng.gen is a Generator"):
        ck.pack_state({"rng": {"gen": torch.Generator()}}, {})


def test_saving_an_existing_step_replaces_it_whole(tmp_path):
    w = {"w": torch.zeros(2)}
    ck.save(tmp_path, 1, 1, w, {"v": 1}, IDENTITY, {})
    (tmp_path / "checkpoints" / "step_000001" / "stale_extra").write_text("x")
    ck.save(tmp_path, 1, 1, {"w": torch.ones(2)}, {"v": 2}, IDENTITY, {})
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert not (root / "step_000001" / "stale_extra").exists()
    assert ck.resume_point(tmp_path, IDENTITY, {}).trainer_state == {"v": 2}


def test_resume_cuts_only_what_it_recomputes(tmp_path):
    ck.save(tmp_path, 2, 2, {"w": torch.zeros(1)}, {}, IDENTITY, {})
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(4)) + '{"step": 4, "mism')
    for s in range(4):
        (tmp_path / "records").mkdir(exist_ok=True)
        (tmp_path / "records" / f"step_{s:06d}.parquet").write_text("")
    ck.resume_point(tmp_path, IDENTITY, {})  # verifies; changes nothing
    assert metrics.read_text().endswith('"mism')
    ck.truncate_run(tmp_path, 2)
    assert metrics.read_text() == '{"step": 0}\n{"step": 1}\n'
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == ["step_000000.parquet", "step_000001.parquet"]
    metrics.write_text('{"step": 0}\n{"step": 1, "x"\n{"step": 2}\n')
    with pytest.raises(ck.CheckpointError, match=r"metrics.jsonl: line 2 is not JSON"):
        ck.resume_point(tmp_path, IDENTITY, {})


def test_sample_seeds():
    seeds = {ck.sample_seed(1234, step, i) for step in range(4) for i in range(64)}
    assert len(seeds) == 256 and all(0 <= s < 2**63 for s in seeds)
    assert ck.sample_seed(1234, 3, 5) == ck.sample_seed(1234, 3, 5) != ck.sample_seed(1235, 3, 5)
