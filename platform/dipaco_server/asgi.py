"""ASGI entry point, for servers that speak ASGI (the project ships gunicorn/WSGI)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dipaco_server.settings")

application = get_asgi_application()
