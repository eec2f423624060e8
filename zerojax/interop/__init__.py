"""Params in and out: consolidated params of a checkpoint, Hugging Face Llama folders, a run started
from given params, and sampling text from a checkpoint."""
