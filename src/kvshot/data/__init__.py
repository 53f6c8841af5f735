"""Conversations: sources (ShareGPT, hub sets), the split, the chat template, the tokenizer."""
