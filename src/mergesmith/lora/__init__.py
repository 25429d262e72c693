"""LoRA adapters: `extract` factors `fine-tune - base` into a PEFT adapter (reading one is `io.lora_adapter`)."""
