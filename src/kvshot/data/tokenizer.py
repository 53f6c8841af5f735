"""The target's tokenizer: a byte-level BPE trained on the train split (embedded
default), a pretrained one (paper) or the one inside a GGUF target's file, saved as a HF
fast tokenizer either way."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvshot.core.io import DataError, atomic_dir, write_json
from kvshot.data.chat import CHAT_TEMPLATE, IM_END, IM_START, render_chat
from kvshot.data.sources import read_jsonl
from kvshot.settings import TokenizerSettings

EOS_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TEXT, IM_START, IM_END]


def _texts(conversations: list[dict]) -> Iterator[str]:
    for conv in conversations:
        yield render_chat(conv["messages"])


def train_bpe(conversations: list[dict], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with the chat special tokens as single, never-split tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(_texts(conversations), trainer=trainer, length=len(conversations))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,          # generation stops at end of turn, as Qwen3's chat models do
        pad_token=EOS_TEXT,
        additional_special_tokens=[IM_START],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def check_chat_tokens(tokenizer, where: str) -> None:
    for special in (IM_START, IM_END):
        ids = tokenizer.encode(special, add_special_tokens=False)
        if len(ids) != 1:
            raise DataError(f"{where}: tokenizer does not encode {special} as one token (got {ids})")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def build_tokenizer(tok_cfg: TokenizerSettings, train_jsonl: str | Path, out_dir: str | Path) -> dict:
    """Write a HF tokenizer folder; returns a small summary for the stage's log."""
    if tok_cfg.source == "train":
        tokenizer = train_bpe(read_jsonl(train_jsonl), tok_cfg.vocab_size)
        origin = f"byte-level BPE trained on {train_jsonl}"
    elif tok_cfg.source == "gguf":
        from kvshot.core.gguf import load_gguf_tokenizer

        tokenizer = load_gguf_tokenizer(tok_cfg.gguf)
        origin = f"{tok_cfg.gguf.package}/{tok_cfg.gguf.file} (sha256 {tok_cfg.gguf.sha256[:12]})"
    else:
        tokenizer = AutoTokenizer.from_pretrained(tok_cfg.name, revision=tok_cfg.revision)
        origin = tok_cfg.name + (f"@{tok_cfg.revision}" if tok_cfg.revision else "")
    check_chat_tokens(tokenizer, origin if tok_cfg.source == "gguf" else str(tok_cfg.name or train_jsonl))
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    summary = {"origin": origin, "vocab_size": len(tokenizer),
               "im_start_id": tokenizer.convert_tokens_to_ids(IM_START),
               "im_end_id": tokenizer.convert_tokens_to_ids(IM_END),
               "pad_id": tokenizer.pad_token_id}
    with atomic_dir(out_dir) as tmp:
        tokenizer.save_pretrained(tmp)
        write_json(Path(tmp) / "kvshot_tokenizer.json", summary)
    return summary


def load_tokenizer(path: str | Path):
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    check_chat_tokens(tokenizer, str(path))
    return tokenizer
