"""Developer tools: the real Qwen vocabulary as an HF ``tokenizer.json`` (``qwen_vocab``) and
random-weight checkpoints of any registered family's shape (``random_checkpoint``)."""
