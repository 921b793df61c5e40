"""Attention surgery on pretrained Hugging Face checkpoints."""

__version__ = "0.1.0"
