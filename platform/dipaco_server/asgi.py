"""ASGI entry point, for servers that speak ASGI (the project ships gunicorn/WSGI)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dipaco_server.settings")

application = get_asgi_application()

# As wsgi.py: the heavy libraries before the first request, not lazily inside one.
from dipaco_server.core.preload import import_heavy_libraries  # noqa: E402

import_heavy_libraries()
