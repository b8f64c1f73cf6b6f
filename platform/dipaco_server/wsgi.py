"""WSGI entry point: ``gunicorn dipaco_server.wsgi:application``."""

import gc
import os

from django.core.wsgi import get_wsgi_application
from django.db import connections

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dipaco_server.settings")

application = get_wsgi_application()

# torch and the modules that use it now, before the first request (not inside one).
from dipaco_server.core.preload import import_heavy_libraries  # noqa: E402

import_heavy_libraries()

# gunicorn --preload runs this module in its master and forks the workers from it: no
# database connection may cross the fork (Django opens one per thread on first use).
connections.close_all()

# Everything loaded so far (Django, the apps, pydantic schemas) lives as long as the
# process: move it out of the collector's sight, so full collections under load scan
# only what requests allocate (the practice CPython's gc.freeze was added for).
gc.freeze()
