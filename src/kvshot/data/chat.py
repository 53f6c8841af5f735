"""Chat rendering and tokenization, one path for training text and for eval prompts.

The embedded default (kvshot's own BPE) renders ChatML with `render_chat` / CHAT_TEMPLATE.
A pretrained tokenizer that carries its own chat template (Qwen3) renders through it with
thinking disabled (`enable_thinking=False`): Qwen3's generation prompt then ends with an
empty `<think>\\n\\n</think>\\n\\n` block, and the training text holds the same block before
the final answer, so the drafters train on the text the target answers in at eval time.
"""
from __future__ import annotations

from typing import Any

from kvshot.core.io import DataError

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# Jinja twin of render_chat, for tokenizer.chat_template; tests check they agree.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """ChatML (Qwen3 without thinking blocks) rendering of a conversation."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def uses_own_template(tokenizer: Any) -> bool:
    """True for a tokenizer whose chat template is not kvshot's embedded ChatML one."""
    template = getattr(tokenizer, "chat_template", None)
    return bool(template) and template != CHAT_TEMPLATE


def render_conversation(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The text the target sees: its own template with thinking disabled, or ChatML."""
    if not uses_own_template(tokenizer):
        return render_chat(messages, add_generation_prompt)
    # enable_thinking is a template variable: templates without it ignore it
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         enable_thinking=False)


def encode_prompt(tokenizer: Any, messages: list[dict], max_len: int | None = None) -> list[int]:
    """Token ids of an eval/generation prompt: `messages` and the assistant header (Qwen3:
    with its empty think block). A long prompt keeps its end, the part next to the answer."""
    ids = tokenizer.encode(render_conversation(tokenizer, messages, add_generation_prompt=True),
                           add_special_tokens=False)
    return ids[-max_len:] if max_len else ids


def assistant_spans(text: str, messages: list[dict]) -> list[tuple[int, int]]:
    """Character spans of each assistant answer + its <|im_end|> in a rendered conversation.
    Every message's content is found in order, anchored on the <|im_end|> that closes it (a
    role name or template text cannot match that). Templates may strip leading newlines, and
    Qwen3's moves text before a `</think>` in an answer into its think block."""
    spans, cursor = [], 0
    for index, m in enumerate(messages):
        content = m["content"]
        after_think = content.split("</think>")[-1].lstrip("\n")
        for candidate in dict.fromkeys((content, content.lstrip("\n"), content.strip(), after_think)):
            start = text.find(candidate + IM_END, cursor)
            if start >= 0:
                break
        else:
            raise DataError(f"chat template: message {index} ({m['role']}) is not rendered verbatim before {IM_END}")
        cursor = start + len(candidate) + len(IM_END)
        if m["role"] == "assistant":
            spans.append((start, cursor))
    return spans


def tokenize_conversation(tokenizer: Any, messages: list[dict], max_len: int) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a mask selecting assistant text + <|im_end|>.
    Pieces are encoded separately so token boundaries fall on turn boundaries and the mask
    is exact; an answer starts on a token boundary, as it does after an eval prompt."""
    ids: list[int] = []
    mask: list[int] = []

    def add(piece: str, weight: int) -> None:
        piece_ids = tokenizer.encode(piece, add_special_tokens=False) if piece else []
        ids.extend(piece_ids)
        mask.extend([weight] * len(piece_ids))

    if not uses_own_template(tokenizer):
        for m in messages:
            add(f"{IM_START}{m['role']}\n", 0)
            add(f"{m['content']}{IM_END}", int(m["role"] == "assistant"))
            add("\n", 0)
            if len(ids) >= max_len:
                break
        return ids[:max_len], mask[:max_len]
    text = render_conversation(tokenizer, messages)
    cursor = 0
    for start, end in assistant_spans(text, messages):
        add(text[cursor:start], 0)
        add(text[start:end], 1)
        cursor = end
        if len(ids) >= max_len:
            break
    else:
        add(text[cursor:], 0)
    return ids[:max_len], mask[:max_len]
