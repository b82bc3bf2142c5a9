"""partrain: declarative parallel training of Hugging Face language models."""

__version__ = "0.1.0"
