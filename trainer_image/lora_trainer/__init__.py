"""lora_trainer: the program every TPU host runs (train, export, convert, logits)."""

__version__ = "0.1.0"
