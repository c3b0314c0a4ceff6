"""A model or data file that a recipe builds once and later runs reuse is reused only as what the config asks for:
a tiny model whose recorded model.tiny keys differ, or generated data whose data.generate / data.num_rows differ, is
refused naming the keys (before, any existing directory or file was taken as it was, silently); another run.seed, a
file without a record, is said on the console. And what a killed engine leaves in /dev/shm is swept by the next."""
import json

import pytest

from vime.config import ConfigError, TinyModelSection
from vime.controller import _check_generated
from vime.warmstart import _check_built, _tiny_dict


def _marker(path, tiny, seed):
    path.mkdir(exist_ok=True)
    (path / "vime_warmstart.json").write_text(json.dumps({"seed": seed, "model_tiny": _tiny_dict(tiny)}))


def test_a_tiny_model_built_with_other_keys_is_refused(tmp_path, capsys):
    built = TinyModelSection()
    _marker(tmp_path / "m", built, 1234)
    _check_built(tmp_path / "m", TinyModelSection(), 1234)  # the same keys and seed: used, nothing said
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match=r"^model\.path: .*model\.tiny\.hidden_size=64 there, 96 here.*Fix: delete"):
        _check_built(tmp_path / "m", TinyModelSection(hidden_size=96), 1234)
    with pytest.raises(ConfigError, match=r"model\.tiny\.warmstart_steps=80 there, 20 here"):
        _check_built(tmp_path / "m", TinyModelSection(warmstart_steps=20), 1234)
    _check_built(tmp_path / "m", TinyModelSection(), 7)  # another seed: used, and said
    assert "was built with run.seed=1234; this run's run.seed=7" in capsys.readouterr().err
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "vime_warmstart.json").write_text(json.dumps({"steps": 80, "lr": 0.003, "seed": 7}))
    _check_built(tmp_path / "old", TinyModelSection(), 1234)  # an earlier vime's marker: said
    assert "did not record its model.tiny keys" in capsys.readouterr().err


def test_generated_data_with_other_settings_is_refused(tmp_path, capsys):
    data, record = tmp_path / "d.parquet", tmp_path / "d.parquet.vime.json"
    data.write_bytes(b"rows")
    made = {"generate": "addition", "num_rows": 2000, "seed": 1234}
    _check_generated(data, record, made)  # no record: used, and said
    assert "exists without a record of how it was generated" in capsys.readouterr().err
    record.write_text(json.dumps(made))
    _check_generated(data, record, made)
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match=r"^data\.path: .*data\.num_rows=2000 there, 50 here.*Fix: delete"):
        _check_generated(data, record, {**made, "num_rows": 50})
    with pytest.raises(ConfigError, match=r"data\.generate='addition' there, 'word_problems' here"):
        _check_generated(data, record, {**made, "generate": "word_problems"})
    _check_generated(data, record, {**made, "seed": 9})
    assert "generated with run.seed=1234; this run's run.seed=9" in capsys.readouterr().err


def test_reload_directories_of_engines_that_are_gone_are_swept(tmp_path):
    """A stock engine's reload directory (a float32 copy of the model, in /dev/shm where it fits) outlives an engine
    that Ray killed (no atexit handler runs): the next engine's first reload removes those of processes that no
    longer run, and only those."""
    import os
    import subprocess
    import sys

    from vime.rollout import _sweep_reload_dirs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # exited: no such process now (barring reuse of its id within this test)
    gone, alive, other = (tmp_path / f"vime_reload_{pid}_ab_c1", tmp_path / f"vime_reload_{os.getpid()}_x2",
                          tmp_path / "vime_reload_nopid")
    for d in (gone, alive, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"w")
    assert _sweep_reload_dirs(str(tmp_path)) == [str(gone)]
    assert not gone.exists() and alive.exists() and other.exists()
