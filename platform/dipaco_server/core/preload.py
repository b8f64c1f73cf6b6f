"""Import the heavy libraries once, when a server process starts, not inside requests.

transformers resolves its names lazily (``from transformers import LlamaConfig`` imports
the submodule on first use), and that first use is not thread-safe: two threads of a
gthread gunicorn worker that both touch it first can see ``ImportError: cannot import
name 'LlamaConfig'``. The first request to need torch or a model class would also
stall for seconds. wsgi.py and asgi.py call `import_heavy_libraries` before the
process takes requests (and before gc.freeze, so the modules are frozen too).
"""

from __future__ import annotations

import importlib

# Every module a request can reach that imports torch, transformers or tokenizers.
MODULES = (
    "torch",
    "safetensors.torch",
    "tokenizers",
    "transformers",
    "dipaco.config",
    "dipaco.model",
    "dipaco.modular",
    "dipaco.inference",
    "dipaco.routing.router",
    "dipaco.data.tokenizer",
    "dipaco_server.inference.card",
    "dipaco_server.inference.services",
    "dipaco_server.inference.routing",
    "dipaco_server.runs.checkpoint",
    "dipaco_server.runs.prepare",
)
# transformers' lazily resolved names the code imports inside functions.
TRANSFORMERS_NAMES = (
    "LlamaConfig",
    "LlamaForCausalLM",
    "GenerationConfig",
    "AutoConfig",
    "AutoModelForCausalLM",
    "AutoTokenizer",
    "PreTrainedTokenizerFast",
)


def import_heavy_libraries() -> None:
    """Import MODULES and resolve TRANSFORMERS_NAMES (seconds, once per process)."""
    for name in MODULES:
        importlib.import_module(name)
    transformers = importlib.import_module("transformers")
    for name in TRANSFORMERS_NAMES:
        getattr(transformers, name)
