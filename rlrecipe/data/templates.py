"""Prompt templates: the one place where a dataset row becomes model input token ids.

Canonical rows store bare user text (`prompt`, or `problem` for eval sets); the template is
applied at load time, so one dataset serves several models. Modes:

- `r1`: the R1 instruction after the problem, then the tokenizer's own chat template.
- `plain`: the text alone through the chat template (tiny synthetic tasks).
- `raw`: the text as the source file wrote it (the row's `raw_prompt`, kept by the converter),
  tokenized the way AReaL did: `tokenizer(text)`, i.e. with the tokenizer's BOS and no chat
  template. boba-106k and boba-SFT-200 prompts already carry the R1 chat template.
- `areal_boba`: AReaL's evaluation prompt for the boba models (AReaL v0.2,
  evaluation/utils.py, prompt type "AReaL-boba"), tokenized with the tokenizer's BOS as vLLM
  did there; independent of the model snapshot's chat template.
"""

from __future__ import annotations

R1_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

TEMPLATES = {
    # DeepSeek-R1 / AReaL-boba: the instruction follows the problem in the user turn.
    "r1": "{prompt}\n" + R1_INSTRUCTION,
    # Tiny synthetic tasks: the prompt alone.
    "plain": "{prompt}",
}
# Whole prompts written as text (no chat template applied afterwards).
TEXT_TEMPLATES = {
    "raw": "{prompt}",
    "areal_boba": "<｜User｜>{prompt}\n" + R1_INSTRUCTION + "<｜Assistant｜><think>\n",
}
TEMPLATE_NAMES = (*TEMPLATES, *TEXT_TEMPLATES)


def render_user_text(prompt: str, template: str) -> str:
    # replace, not format: the R1 instruction itself contains braces (\boxed{})
    return TEMPLATES[template].replace("{prompt}", prompt)


def _text_ids(tokenizer, text: str) -> list[int]:
    # add_special_tokens=True: the tokenizer adds its BOS exactly as AReaL's `tokenizer(prompt)` did
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def prompt_token_ids(tokenizer, prompt: str, template: str) -> list[int]:
    """Token ids of the formatted prompt, ending where the assistant starts to write."""
    if template in TEXT_TEMPLATES:
        return _text_ids(tokenizer, TEXT_TEMPLATES[template].replace("{prompt}", prompt))
    messages = [{"role": "user", "content": render_user_text(prompt, template)}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def row_prompt_text(row: dict, template: str, key: str = "prompt") -> str:
    """The text a template formats: in `raw` mode the source's verbatim prompt when it was kept."""
    if template == "raw":
        return row.get(f"raw_{key}", row[key])
    return row[key]


def row_prompt_ids(tokenizer, row: dict, template: str, key: str = "prompt") -> list[int]:
    """Prompt token ids of a canonical row (`key` is `prompt` for rl/sft rows, `problem` for eval)."""
    return prompt_token_ids(tokenizer, row_prompt_text(row, template, key), template)


def sft_token_ids(tokenizer, row: dict, template: str) -> tuple[list[int], int]:
    """(ids, number of prompt tokens) of an SFT row: prompt + response + EOS.

    `raw` follows AReaL's SFT dataset: the text `prompt + answer + eos_token` is tokenized as one
    string and the loss mask covers the first len(tokenizer(prompt)) tokens, so the ids equal
    AReaL's even where a token spans the prompt/answer boundary. The other modes tokenize the
    prompt through the chat template and append the response tokens and the EOS id.
    """
    if template == "raw":
        prompt = row_prompt_text(row, template)
        answer = row.get("raw_response", row["response"])
        ids = _text_ids(tokenizer, prompt + answer + tokenizer.eos_token)
        return ids, len(_text_ids(tokenizer, prompt))
    prompt_ids = row_prompt_ids(tokenizer, row, template)
    response = tokenizer.encode(row["response"], add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt_ids + response, len(prompt_ids)
