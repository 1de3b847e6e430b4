"""Model code: resolving a model argument, loading weights and tokenizer, the Llama decoder."""
