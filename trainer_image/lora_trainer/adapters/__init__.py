"""Adapters both ways: Orbax LoRA checkpoints <-> HF PEFT adapters, merged models, and a logits tool.

`peft_format` reads and writes PEFT's files, `mapping` turns the trainer's LoRA tree into PEFT
tensors and back with the family's HF<->NNX table, and `export`/`convert`/`logits`/`merge`
are what the `lora-trainer` subcommands call.
"""
