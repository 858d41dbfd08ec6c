"""Adapters both ways: Orbax LoRA checkpoints <-> HF PEFT adapters, merged models, and a logits tool.

`peft_format` reads and writes PEFT's files, `mapping` turns the trainer's LoRA tree into PEFT
tensors and back with the family's HF<->NNX table, `base_model` reads what a conversion needs
from the base's config.json, `merge` adds an adapter to HF weights, and `export`/`convert`/
`logits` are what the `lora-trainer` subcommands call.
"""
