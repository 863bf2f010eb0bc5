"""Prompt formats shared by training data and benchmarks (the published evaluation formats)."""

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE_TEMPLATE = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"


def math_prompt(problem: str) -> str:
    return f"{problem}{MATH_SUFFIX}"


def code_prompt(prompt: str) -> str:
    return CODE_TEMPLATE.format(prompt=prompt)


def instruction_prompt(instruction: str, context: str = "") -> str:
    return f"{instruction}\n\nInput:\n{context}" if context and context.strip() else instruction


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of ``messages`` in the tokenizer's chat template, ready for the assistant's turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
