"""A chat request as the model reads it, with no torch (the gateway renders chats and never loads
torch)."""

from __future__ import annotations


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages rendered with the tokenizer's chat template, ready for the assistant's turn:
    how the gateway sends a chat request (and so what distillation must generate from)."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
