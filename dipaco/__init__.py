"""dipaco: DiPaCo and DiLoCo training, as a library shared by the worker and the server.

This package is pure: no Django, no HTTP. The control plane lives in
``dipaco_server`` (``platform/``) and the volunteer client in ``worker_agent``.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "load_path"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import dipaco` stays cheap: load_path pulls in torch and transformers.
    if name == "load_path":
        from dipaco.inference import load_path

        return load_path
    raise AttributeError(f"module 'dipaco' has no attribute {name!r}")
