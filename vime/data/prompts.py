"""Prompt datasets: local Parquet/JSONL in dapo-math-17k or gsm8k layout.

What this module decides: how a row becomes a `Prompt` (chat messages + ground
truth) and what happens to malformed rows — they are skipped and counted (and
the count logged), or raise when `strict=True`. Nothing is fetched from a hub.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
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
    skipped: int  # malformed rows skipped


_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


def _from_dapo(row: dict) -> tuple[tuple, str]:
    msgs = row["prompt"]
    if isinstance(msgs, str):
        msgs = [{"role": "user", "content": msgs}]
    messages = tuple((m["role"], m["content"]) for m in msgs)
    truth = row["reward_model"]["ground_truth"]
    if not messages or truth in (None, ""):
        raise ValueError("empty prompt or ground truth")
    return messages, str(truth)


def _from_gsm8k(row: dict, template: str) -> tuple[tuple, str]:
    m = _GSM8K_ANSWER.search(row["answer"])
    if not m or not row["question"].strip():
        raise ValueError("no '#### answer' in gsm8k row")
    return (("user", template.format(question=row["question"].strip())),), m.group(1).replace(",", "")


def load_prompts(path: str | Path, layout: str = "dapo", *, strict: bool = False,
                 template: str = "{question}\nPut the final answer after 'Answer:'.") -> tuple[list[Prompt], LoadReport]:
    """Read a local .parquet / .jsonl / .json file; returns prompts and a report of skipped rows."""
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
    prompts, skipped = [], 0
    for i, row in enumerate(ds):
        try:
            messages, truth = _from_dapo(row) if layout == "dapo" else _from_gsm8k(row, template)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if strict:
                raise ValueError(f"{path}: row {i} is malformed for layout {layout!r}: {e}") from e
            skipped += 1
            continue
        pid = str(row.get("prompt_id") or row.get("extra_info", {}) and (row.get("extra_info") or {}).get("index") or i)
        prompts.append(Prompt(prompt_id=pid, messages=messages, ground_truth=truth))
    if skipped:
        log.warning("%s: skipped %d malformed rows of %d", path, skipped, len(ds))
    if not prompts:
        raise ValueError(f"{path}: no usable rows for layout {layout!r} ({skipped} malformed)")
    return prompts, LoadReport(str(path), len(ds), len(prompts), skipped)
