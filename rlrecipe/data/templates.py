"""Prompt templates: the one place where a dataset prompt becomes model input.

Datasets store bare user text; the template and the tokenizer's chat template are applied at
load time, so one dataset serves several models.
"""

from __future__ import annotations

R1_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

TEMPLATES = {
    # DeepSeek-R1 / AReaL-boba: the instruction follows the problem in the user turn.
    "r1": "{prompt}\n" + R1_INSTRUCTION,
    # Tiny synthetic tasks: the prompt alone.
    "plain": "{prompt}",
}


def render_user_text(prompt: str, template: str) -> str:
    # replace, not format: the R1 instruction itself contains braces (\boxed{})
    return TEMPLATES[template].replace("{prompt}", prompt)


def prompt_token_ids(tokenizer, prompt: str, template: str) -> list[int]:
    """Token ids of the chat-formatted prompt, ending where the assistant starts to write."""
    messages = [{"role": "user", "content": render_user_text(prompt, template)}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)
