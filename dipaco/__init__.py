"""dipaco: DiPaCo and DiLoCo training, as a library shared by the worker and the server.

No Django and nothing of the server: the control plane lives in ``dipaco_server``
(``platform/``), the demo that runs everything on one machine in ``dipaco_demo``, and the
volunteer client in ``worker_agent``; tests/test_boundaries.py keeps it so. One module
speaks HTTP: ``dipaco.client``, the client of a server's public API behind
``dipaco download`` and ``load_path``; ``dipaco.retry``, the retry policy it and the
worker agent share, only classifies httpx's errors. The rest is computation on tensors
and files.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "load_path"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import dipaco` stays cheap: load_path pulls in torch and transformers.
    if name == "load_path":
        from dipaco.client import load_path  # lazy: see above

        return load_path
    raise AttributeError(f"module 'dipaco' has no attribute {name!r}")
