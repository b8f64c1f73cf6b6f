"""Data: corpora, the run's tokenizer, and per-path token shards."""
