"""lora_operator: runs LoraFinetune and AdapterConversion resources as TPU JobSets and Jobs."""

__version__ = "0.1.0"
