"""Training data: the embedded corpus, its tokenizer, and the plan-independent sample order."""
