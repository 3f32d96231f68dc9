"""The chat template of the embedded model, which knows only plays: each message is a speech.

    SYSTEM.\\n{system text}\\n\\nUSER.\\n{user text}\\n\\nASSISTANT.\\n

A message becomes its role in capitals and a full stop on a line of its own (how the plays name
their speakers), then its text and a blank line; the prompt ends with "ASSISTANT.\\n", so the model
speaks next as that character. A hub model with a chat template of its own uses that instead
(tokenizer.apply_chat_template).
"""


def render_chat(messages, tokenizer) -> str | list[int]:
    """The prompt for a list of {"role", "content"} messages: text for the embedded template, ids for a hub model's."""
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True))
    return "".join(f"{m['role'].upper()}.\n{m['content']}\n\n" for m in plain) + "ASSISTANT.\n"
