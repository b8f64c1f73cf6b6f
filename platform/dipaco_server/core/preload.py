"""Import the heavy libraries once, when a server process starts, not inside requests.

The first request to need torch or safetensors would otherwise stall for seconds. wsgi.py
and asgi.py call `import_heavy_libraries` before the process takes requests (and before
gc.freeze, so the modules are frozen too). transformers is not among them: the path model
is plain torch (dipaco.model), config.json is written without it, and the one request that
needs it (the dashboard's generation, through transformers' Auto classes) imports it
through `dipaco.hf.transformers`, once and under a lock, since transformers' lazily
resolved names are not safe to resolve from two threads at once.
"""

from __future__ import annotations

import importlib

# Every module a request can reach that imports torch, safetensors or tokenizers.
MODULES = (
    "torch",
    "safetensors.torch",
    "tokenizers",
    "dipaco.config",
    "dipaco.model",
    "dipaco.modular",
    "dipaco.inference",
    "dipaco.routing.router",
    "dipaco.tokenizer",
    "dipaco_server.inference.card",
    "dipaco_server.inference.services",
    "dipaco_server.inference.routing",
    "dipaco_server.runs.checkpoint",
    "dipaco_server.runs.prepare",
)


def import_heavy_libraries() -> None:
    """Import MODULES (seconds, once per process)."""
    for name in MODULES:
        importlib.import_module(name)
