"""transformers, imported on first use, once, under a lock.

dipaco's path model is plain torch (dipaco.model), so the processes that train, score and
serve paths never import transformers; only the consumers of a downloaded path do (its
Auto classes, a foreign tokenizer, the LlamaConfig object). transformers resolves its names
lazily, and that first resolution is not thread-safe: two threads of a gthread gunicorn
worker touching a name first can see ``ImportError: cannot import name 'LlamaConfig'``.
`transformers()` imports the package and resolves, under one lock, the names the project
uses and those the Auto classes reach when they open a path, so later lookups only read
attributes.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

__all__ = ["NAMES", "transformers"]

NAMES = (
    "AutoConfig",
    "AutoModelForCausalLM",
    "AutoTokenizer",
    "GenerationConfig",
    "LlamaConfig",
    "LlamaForCausalLM",
    "PreTrainedTokenizerFast",
)
_lock = threading.Lock()
_module: Any = None


def transformers() -> Any:
    """The transformers package with NAMES resolved (seconds of CPU, the first time)."""
    global _module
    with _lock:
        if _module is None:
            module = importlib.import_module("transformers")
            for name in NAMES:
                getattr(module, name)
            _module = module
    return _module
