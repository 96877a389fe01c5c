"""Convert raw dataset files (hub downloads or local files) into canonical rows.

Raw files: JSONL, JSON (a list of objects, or an object holding one such list) or Parquet,
recognised by content. Row shapes understood:

- AReaL RL (`areal-rl`): `query_id`, `prompt` (often with the R1 chat template and instruction
  already applied), `solutions` (list, often `\\boxed{...}`), `task`.
- AReaL SFT (`areal-sft`): `prompt` (same template), `answer` (the teacher's response).
- Eval sets (`eval`): `problem`, `answer` (AIME answers are integers), optional `id`.

Common alternative column names (question, query, instruction, response, output, ground_truth,
ID, Problem, Answer, ...) are accepted too. Conversion keeps only user text in prompts (chat
template tokens and the R1 instruction are stripped: the template is applied again at load time,
see templates.py) and keeps the source's text verbatim beside it as `raw_prompt` (and `raw_response`)
when the two differ, for the `raw` template that trains on exactly the source's tokens; strips a surrounding `\\boxed{}` from reference answers, writes answers as
strings, keeps only math rows when a `task` column is present, and gives every row a unique id.
Rows that cannot be converted are rejected with a reason; nothing is silently dropped.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rlrecipe.core.errors import UserError
from rlrecipe.data.io import answer_text, check_row

ID_KEYS = ("id", "query_id", "ID", "Id", "unique_id", "problem_id", "qid", "idx")
PROMPT_KEYS = ("prompt", "problem", "question", "query", "Problem", "Question", "instruction")
RL_ANSWER_KEYS = ("answers", "solutions", "answer", "ground_truth", "Answer", "final_answer")
SFT_RESPONSE_KEYS = ("response", "answer", "completion", "output", "Response", "Answer")
EVAL_ANSWER_KEYS = ("answer", "Answer", "answers", "ground_truth", "final_answer", "solutions")

# DeepSeek-R1 special tokens use full-width bars: <｜User｜>, <｜Assistant｜>, <｜begin▁of▁sentence｜>.
_R1_TOKEN = re.compile(r"<｜[^｜<>]{1,40}｜>")
_CHATML_TOKEN = re.compile(r"<\|(?:im_start|im_end|endoftext|eot_id|start_header_id|end_header_id|begin_of_text)\|>")
_THINK = re.compile(r"</?think>")
_INSTRUCTIONS = [
    re.compile(r"please\s+reason\s+step\s+by\s+step,?\s+and\s+put\s+your\s+final\s+answer\s+within\s+"
               r"\\boxed\{\s*\}\.?", re.IGNORECASE),
    re.compile(r"let'?s\s+think\s+step\s+by\s+step\s+and\s+output\s+the\s+final\s+answer\s+within\s+"
               r"\\boxed\{\s*\}\.?", re.IGNORECASE),
]
_EOS_SUFFIXES = ("<｜end▁of▁sentence｜>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>")


@dataclass
class ConversionReport:
    source: str
    kind: str
    total: int = 0
    kept: int = 0
    converted: int = 0
    rejected: int = 0
    reasons: Counter = field(default_factory=Counter)
    changes: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def reject(self, where: str, reason: str) -> None:
        self.rejected += 1
        self.reasons[reason.split(" (")[0]] += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {reason}")

    def summary_lines(self) -> list[str]:
        lines = [f"read:      {self.total} rows from {self.source}",
                 f"kept:      {self.kept} ({self.kind} rows written)",
                 f"converted: {self.converted}"
                 + (f" ({', '.join(f'{k}: {v}' for k, v in self.changes.most_common())})" if self.changes else ""),
                 f"rejected:  {self.rejected}"
                 + (f" ({', '.join(f'{k}: {v}' for k, v in self.reasons.most_common())})" if self.reasons else "")]
        lines += [f"  e.g. {e}" for e in self.examples]
        return lines


@dataclass
class ConversionResult:
    rows: list[dict]
    report: ConversionReport


class _Bad:
    """A raw record that could not even be parsed (kept in the stream so it is counted)."""

    def __init__(self, reason: str):
        self.reason = reason


# --- reading raw files ---------------------------------------------------------------------------

def sniff_format(path: Path) -> str:
    """'parquet', 'json' or 'jsonl', from the file's first bytes and name."""
    with path.open("rb") as f:
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        return "parquet"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if text.startswith(b"[") or (path.suffix == ".json" and text.startswith(b"{")):
        return "json"
    return "jsonl"


def read_raw(path: str | Path) -> Iterator[tuple[str, object]]:
    """Yield (location, record) for every raw record; unparsable records come as _Bad."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: file not found")
    if path.is_dir():
        raise UserError(f"{path}: is a directory, expected a .jsonl, .json or .parquet file")
    fmt = sniff_format(path)
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq

            table = pq.read_table(path)
        except Exception as err:  # pyarrow raises several types for corrupt files
            raise UserError(f"{path}: cannot read as Parquet ({err})") from None
        for i, row in enumerate(table.to_pylist(), 1):
            yield f"row {i}", row
    elif fmt == "json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            if err.msg == "Extra data":  # one object per line after all: JSONL named .json
                yield from _read_jsonl_records(path)
                return
            raise UserError(f"{path}:{err.lineno}: malformed JSON ({err.msg})") from None
        except UnicodeDecodeError:
            raise UserError(f"{path}: not valid UTF-8") from None
        except RecursionError:
            raise UserError(f"{path}: JSON nested too deeply") from None
        except ValueError as err:  # an integer of thousands of digits (Python's conversion limit)
            raise UserError(f"{path}: a number too long to read ({str(err).split(';')[0]})") from None
        if isinstance(data, dict):
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise UserError(f"{path}: expected a JSON list of rows, or an object holding exactly one list")
            data = lists[0]
        if not isinstance(data, list):
            raise UserError(f"{path}: expected a JSON list of rows")
        for i, row in enumerate(data, 1):
            yield f"item {i}", row
    else:
        yield from _read_jsonl_records(path)


def _read_jsonl_records(path: Path) -> Iterator[tuple[str, object]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield f"line {lineno}", _Bad("not valid UTF-8")
                continue
            if not line.strip():
                continue
            try:
                yield f"line {lineno}", json.loads(line)
            except json.JSONDecodeError as err:
                yield f"line {lineno}", _Bad(f"malformed JSON ({err.msg} at column {err.colno})")
            except RecursionError:
                yield f"line {lineno}", _Bad("JSON nested too deeply")
            except ValueError as err:  # an integer of thousands of digits (Python's conversion limit)
                yield f"line {lineno}", _Bad(f"a number too long to read ({str(err).split(';')[0]})")


# --- text clean-up -------------------------------------------------------------------------------

def strip_template(text: str) -> tuple[str, list[str]]:
    """Only the user's text of a chat-formatted prompt; returns (text, list of changes made)."""
    changes = []
    out = text
    if "<｜User｜>" in out:
        out = out.rsplit("<｜User｜>", 1)[1].split("<｜Assistant｜>", 1)[0]
    elif "<|im_start|>user" in out:
        out = out.rsplit("<|im_start|>user", 1)[1].split("<|im_end|>", 1)[0]
    out = _CHATML_TOKEN.sub("", _R1_TOKEN.sub("", out))
    out = _THINK.sub("", out)
    if out != text:
        changes.append("chat template stripped")
    before = out
    for pattern in _INSTRUCTIONS:
        out = pattern.sub("", out)
    if out != before:
        changes.append("instruction stripped")
    return out.strip(), changes


def _matching_brace(s: str, open_idx: int) -> int:
    depth = 0
    for i in range(open_idx, len(s)):
        if s[i] == "{" and (i == 0 or s[i - 1] != "\\"):
            depth += 1
        elif s[i] == "}" and (i == 0 or s[i - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return i
    return -1


def strip_boxed(answer: str) -> str:
    """`\\boxed{42}` -> `42` when the box wraps the whole answer (also inside $...$); else unchanged."""
    s = answer.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) > len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left):-len(right)].strip()
            break
    for prefix in ("\\boxed{", "\\fbox{"):
        if s.startswith(prefix) and _matching_brace(s, len(prefix) - 1) == len(s) - 1:
            inner = s[len(prefix):-1].strip()
            return inner if inner else answer.strip()
    return answer.strip()


def _first(row: dict, keys: tuple[str, ...]) -> tuple[str | None, object]:
    for key in keys:
        if key in row and row[key] is not None:
            return key, row[key]
    return None, None


# --- row conversion ------------------------------------------------------------------------------

def _convert_one(row: dict, kind: str) -> tuple[dict | None, str | None, list[str]]:
    """(canonical row without id, None, changes) or (None, reason, [])."""
    changes: list[str] = []
    task = row.get("task")
    if task is not None and str(task).strip().lower() != "math":
        return None, f"task {str(task)!r} is not math", []
    if kind == "eval":
        pkey, problem = _first(row, ("problem", "question", "Problem", "Question", "prompt", "query"))
    else:
        pkey, problem = _first(row, PROMPT_KEYS)
    if pkey is None:
        return None, "no prompt field (tried " + ", ".join(PROMPT_KEYS) + ")", []
    if not isinstance(problem, str):
        return None, f"field {pkey!r} is not a string", []
    text, template_changes = strip_template(problem)
    changes += template_changes
    if not text:
        return None, f"field {pkey!r} is empty", []
    # the source's own text, byte for byte, for the `raw` template (templates.py)
    raw = {"raw_prompt": problem} if problem != text else {}

    if kind == "rl":
        return _rl_row(row, text, raw, changes)
    if kind == "sft":
        return _sft_row(row, text, raw, changes)
    return _eval_row(row, text, raw, changes)


def _rl_row(row: dict, text: str, raw: dict, changes: list[str]) -> tuple[dict | None, str | None, list[str]]:
    """An RL row's reference answers (a list; boxes removed, numbers as text) beside its prompt."""
    akey, answers = _first(row, RL_ANSWER_KEYS)
    if akey is None:
        return None, "no reference answer field (tried " + ", ".join(RL_ANSWER_KEYS) + ")", []
    if not isinstance(answers, list):
        answers = [answers]
    out_answers = []
    for a in answers:
        s = answer_text(a)
        if s is None:
            continue
        if not isinstance(a, str):
            changes.append("number -> string")
        stripped = strip_boxed(s)
        if stripped != s.strip():
            changes.append("\\boxed{} removed")
        if stripped:
            out_answers.append(stripped)
    if not out_answers:
        return None, f"empty reference answers (field {akey!r})", []
    return {"prompt": text, "answers": list(dict.fromkeys(out_answers)), **raw}, None, changes


def _sft_row(row: dict, text: str, raw: dict, changes: list[str]) -> tuple[dict | None, str | None, list[str]]:
    """An SFT row's response (a trailing eos token stripped) beside its prompt."""
    rkey, response = _first(row, SFT_RESPONSE_KEYS)
    if rkey is None:
        return None, "no response field (tried " + ", ".join(SFT_RESPONSE_KEYS) + ")", []
    if not isinstance(response, str):
        return None, f"field {rkey!r} is not a string", []
    resp = response.rstrip()
    for eos in _EOS_SUFFIXES:
        if resp.endswith(eos):
            resp = resp[: -len(eos)].rstrip()
            changes.append("eos token stripped")
    if not resp.strip():
        return None, f"field {rkey!r} is empty", []
    if resp != response:
        raw["raw_response"] = response
    return {"prompt": text, "response": resp, **raw}, None, changes


def _eval_row(row: dict, text: str, raw: dict, changes: list[str]) -> tuple[dict | None, str | None, list[str]]:
    """An eval row: its problem and exactly one answer (box removed, a number as text)."""
    akey, answer = _first(row, EVAL_ANSWER_KEYS)
    if akey is None:
        return None, "no answer field (tried " + ", ".join(EVAL_ANSWER_KEYS) + ")", []
    if isinstance(answer, list):
        if len(answer) != 1:
            return None, f"field {akey!r} holds {len(answer)} answers; an eval row needs exactly one", []
        answer = answer[0]
    s = answer_text(answer)
    if s is None or not s.strip():
        return None, f"empty answer (field {akey!r})", []
    if not isinstance(answer, str):
        changes.append("number -> string")
    stripped = strip_boxed(s)
    if stripped != s.strip():
        changes.append("\\boxed{} removed")
    raw = {"raw_problem": raw["raw_prompt"]} if raw else {}
    return {"problem": text, "answer": stripped, **raw}, None, changes


def convert_records(records, kind: str, *, name: str, source: str) -> ConversionResult:
    """Convert (location, raw record) pairs to canonical rows of `kind`, with a report."""
    if kind not in ("rl", "sft", "eval"):
        raise UserError(f"unknown dataset kind {kind!r}; expected rl, sft or eval")
    report = ConversionReport(source=source, kind=kind)
    rows: list[dict] = []
    seen_ids: set[str] = set()
    for index, (where, raw) in enumerate(records, 1):
        report.total += 1
        if isinstance(raw, _Bad):
            report.reject(where, raw.reason)
            continue
        if not isinstance(raw, dict):
            report.reject(where, f"expected an object, got {type(raw).__name__}")
            continue
        body, reason, changes = _convert_one(raw, kind)
        if reason is not None:
            report.reject(where, reason)
            continue
        _, rid = _first(raw, ID_KEYS)
        rid = answer_text(rid) if rid is not None else None
        if rid is None or not rid.strip():
            rid = f"{name}-{index}"
            changes.append("id assigned")
        rid = rid.strip()
        if rid in seen_ids:
            k = 2
            while f"{rid}#{k}" in seen_ids:
                k += 1
            rid = f"{rid}#{k}"
            changes.append("duplicate id renamed")
        row, problem = check_row({"id": rid, **body}, kind)
        if problem is not None:  # should not happen: conversion builds canonical rows
            report.reject(where, problem)
            continue
        seen_ids.add(rid)
        rows.append(row)
        report.kept += 1
        if changes:
            report.converted += 1
            report.changes.update(list(dict.fromkeys(changes)))
    return ConversionResult(rows=rows, report=report)


def convert_file(path: str | Path, kind: str, *, name: str | None = None, source: str | None = None
                 ) -> ConversionResult:
    path = Path(path)
    return convert_records(read_raw(path), kind, name=name or path.stem, source=source or str(path))
