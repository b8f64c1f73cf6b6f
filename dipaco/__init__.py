"""dipaco: DiPaCo and DiLoCo training, as a library shared by the worker and the server.

This package is pure: no Django, no HTTP. The control plane lives in
``dipaco_server`` (``platform/``) and the volunteer client in ``worker_agent``.
"""

__version__ = "0.1.0"
