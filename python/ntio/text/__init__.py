"""Text in and out: the tokenizer a GGUF describes and its chat template."""
