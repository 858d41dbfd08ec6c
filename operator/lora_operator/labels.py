"""The labels the operator puts on its children and reads back (pure constants, no imports)."""

#: Label tying every child to its LoraFinetune; handlers watch children by it.
LFT_LABEL = "lora-operator.dev/lorafinetune"
#: Label tying a conversion Job to its AdapterConversion.
ADC_LABEL = "lora-operator.dev/adapterconversion"
#: What a child is for (`train`, `export`, `convert`, ...).
COMPONENT_LABEL = "lora-operator.dev/component"
#: Kueue's queue label on a JobSet.
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
