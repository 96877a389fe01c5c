"""Prompts token for token: what we train and evaluate on equals what AReaL-boba did.

Real boba-format rows (tests/data, copied from AReaL's public files) go through the converter
and the loaders; the reference ids are computed the way AReaL's code did it:
RL  realhf/impl/dataset/math_code_dataset.py: `tokenizer(prompt)`;
SFT realhf/impl/dataset/prompt_answer_dataset.py: `tokenizer(prompt + answer + eos_token)`,
    loss masked over the first `len(tokenizer(prompt))` tokens;
eval evaluation/utils.py prompt type "AReaL-boba", the text handed to vLLM (which adds BOS).
"""

from __future__ import annotations

import json

import pytest

from rlrecipe.data.convert import convert_file
from rlrecipe.data.templates import prompt_token_ids, row_prompt_ids
from rlrecipe.recipe.schema import load_recipe
from rlrecipe.rl.prompts import PromptStream
from rlrecipe.stages.sft import build_sft_samples
from tests.conftest import REPO
from tests.helpers import DATA, build_r1_tokenizer

AREAL_BOBA_EVAL = ("<｜User｜>{problem}\nPlease reason step by step, and put your final answer within "
                   "\\boxed{{}}.<｜Assistant｜><think>\n")


@pytest.fixture(scope="module")
def r1_tok(tmp_path_factory):
    return build_r1_tokenizer(tmp_path_factory.mktemp("r1tok"))


def source_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").splitlines()]


def test_rl_raw_prompts_are_the_source_tokens(r1_tok, tmp_path):
    raw = source_rows("boba_rl_rows.jsonl")
    rows = convert_file(DATA / "boba_rl_rows.jsonl", "rl").rows
    assert len(rows) == len(raw) == 10
    stream = PromptStream(rows, r1_tok, "raw", seed=0, shuffle=False)
    bos = r1_tok.bos_token_id
    for src, row in zip(raw, rows, strict=True):
        areal = r1_tok(src["prompt"])["input_ids"]
        group = stream.next_group(1)
        assert group[0].group_id.startswith(f"{row['id']}@")  # unshuffled: source order
        trained = group[0].prompt_ids
        assert trained == areal
        # one BOS, then the source text byte for byte (leading newline and <think> tail included)
        assert trained[0] == bos and bos not in trained[1:]
        assert r1_tok.decode(trained[1:]) == src["prompt"]


def test_rebuilding_the_template_changes_real_prompts(r1_tok):
    # Why `raw` exists: stripping the template and re-applying it does not give the source back.
    raw = source_rows("boba_rl_rows.jsonl")
    rows = convert_file(DATA / "boba_rl_rows.jsonl", "rl").rows
    differs = [row_prompt_ids(r1_tok, row, "r1") != r1_tok(src["prompt"])["input_ids"]
               for src, row in zip(raw, rows, strict=True)]
    leading_newline = [src["prompt"].startswith("\n") for src in raw]
    assert any(leading_newline) and all(d for d, nl in zip(differs, leading_newline, strict=True) if nl)
    # the one kind of row the rebuild reproduces: no leading newline, `<think>\n` tail, one instruction
    same = [src["prompt"] for src, d in zip(raw, differs, strict=True) if not d]
    assert all(p.startswith("<｜User｜>") and p.endswith("<think>\n") and p.count("Please reason") == 1
               for p in same)


def test_sft_raw_rows_are_tokenized_as_areal_did(r1_tok):
    raw = source_rows("boba_sft_rows.jsonl")
    rows = convert_file(DATA / "boba_sft_rows.jsonl", "sft").rows
    samples, cut = build_sft_samples(rows, r1_tok, "raw", max_length=100_000)
    assert cut == 0 and len(samples) == len(raw) == 3
    for src, sample in zip(raw, samples, strict=True):
        assert sample.input_ids == r1_tok(src["prompt"] + src["answer"] + r1_tok.eos_token)["input_ids"]
        assert sample.start == len(r1_tok(src["prompt"])["input_ids"])
        # the loss covers the answer and the EOS, nothing of the prompt
        assert r1_tok.decode(sample.input_ids[sample.start:]) == src["answer"] + r1_tok.eos_token
        assert sample.input_ids[-1] == r1_tok.eos_token_id


def test_sft_raw_tokenizes_across_the_boundary_like_areal(r1_tok):
    # A prompt ending "<think>\n" and an answer starting "\n": the joint string holds "\n\n",
    # one token here, so AReaL's ids are not prompt ids + answer ids. We match AReaL's.
    prompt = source_rows("boba_rl_rows.jsonl")[0]["prompt"]
    assert prompt.endswith("<think>\n")
    row = {"id": "x", "prompt": "bare", "raw_prompt": prompt, "response": "Okay.", "raw_response": "\nOkay."}
    (sample,), _ = build_sft_samples([row], r1_tok, "raw", max_length=100_000)
    areal = r1_tok(prompt + "\nOkay." + r1_tok.eos_token)["input_ids"]
    separate = r1_tok(prompt)["input_ids"] + r1_tok.encode("\nOkay.", add_special_tokens=False) + [r1_tok.eos_token_id]
    assert areal != separate
    assert sample.input_ids == areal and sample.start == len(r1_tok(prompt)["input_ids"])


def test_sft_keeps_the_source_answer_verbatim(r1_tok, tmp_path):
    # The converter strips trailing space and EOS from `response`; raw mode trains on the source text.
    prompt = source_rows("boba_rl_rows.jsonl")[1]["prompt"]
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"prompt": prompt, "answer": "x \\boxed{9}\n"}, ensure_ascii=False) + "\n")
    (row,) = convert_file(src, "sft").rows
    assert row["response"] == "x \\boxed{9}" and row["raw_response"] == "x \\boxed{9}\n"
    (sample,), _ = build_sft_samples([row], r1_tok, "raw", max_length=100_000)
    assert r1_tok.decode(sample.input_ids[sample.start:]) == "x \\boxed{9}\n" + r1_tok.eos_token


def test_eval_prompt_is_areal_boba_and_agrees_with_the_r1_chat_template(r1_tok, tmp_path):
    rows = convert_file(DATA / "aime25_test.jsonl", "eval").rows
    assert len(rows) == 30
    for row in rows:
        areal = r1_tok(AREAL_BOBA_EVAL.format(problem=row["problem"]))["input_ids"]
        assert row_prompt_ids(r1_tok, row, "areal_boba", key="problem") == areal
        # the post-release R1 chat template renders the same ids through the `r1` mode
        assert row_prompt_ids(r1_tok, row, "r1", key="problem") == areal

    # An early-snapshot template (generation prompt without `<think>\n`) changes `r1`, not `areal_boba`.
    early = (DATA / "r1_chat_template.jinja").read_text().replace("<｜Assistant｜><think>\\n'}}", "<｜Assistant｜>'}}")
    old_tok = build_r1_tokenizer(tmp_path / "early", chat_template=early)
    problem = rows[0]["problem"]
    assert prompt_token_ids(old_tok, problem, "areal_boba") == prompt_token_ids(r1_tok, problem, "areal_boba")
    assert prompt_token_ids(old_tok, problem, "r1") == prompt_token_ids(r1_tok, problem, "r1")[:-2]


@pytest.mark.parametrize("name", ["7b_boba.yaml", "7b_boba_icepop_c3po.yaml"])
def test_7b_recipes_train_on_raw_prompts_and_evaluate_as_areal(name):
    recipe = load_recipe(REPO / "recipes" / name).recipe
    assert recipe.data.prompt_template == "raw"
    assert recipe.data.eval_prompt_template == "areal_boba"
    assert recipe.model.revision == "916b56a44061fd5cd7d6a8fb632557ed4f724f60"
