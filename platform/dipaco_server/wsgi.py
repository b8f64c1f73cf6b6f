"""WSGI entry point: ``gunicorn dipaco_server.wsgi:application``."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dipaco_server.settings")

application = get_wsgi_application()
