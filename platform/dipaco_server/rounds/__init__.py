"""Rounds: outer rounds, their work units, the leases that hand units out, and contributions.

The models, the scheduling policy (``policy``) and the signals between the parts
(``signals``) are here; the rest is in parts, each importing only those before it
(tests/test_layers.py): ``verification`` (every acceptance check; its rules Django-free),
``protocol`` (the worker protocol over HTTP), ``outer`` (one module's outer step and what
it publishes), ``lifecycle`` (a round's life: open, close, deadlines, the tasks) and
``reports`` (contributions and a run's status, read back).
"""
