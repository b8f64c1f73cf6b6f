"""The control plane's commands, ``dipaco server`` and ``dipaco admin``.

They reach the ``dipaco`` command line through the ``dipaco.commands`` entry-point group
(pyproject.toml), so they exist exactly where the server extra is installed; the library's
own commands (``simulate``, ``download``, ``route``, ``generate``) stay in ``dipaco.cli``.
"""
