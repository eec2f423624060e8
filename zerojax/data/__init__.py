"""Batches: the source protocol, the byte corpus, tokenizers and token files."""
