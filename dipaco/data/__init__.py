"""Data: corpora, read and routed into per-path token shards (the tokenizer is
``dipaco.tokenizer``, below this package and the router)."""
