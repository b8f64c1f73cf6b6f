"""The Celery app, configured from Django settings (``CELERY_*`` names).

Workers and beat start with ``celery -A dipaco_server worker`` / ``beat``;
the broker is Redis when ``REDIS_URL`` is set and kombu's filesystem
transport in the data dir otherwise (see ``dipaco_server.env``).
"""

import os

from celery import Celery

# Set before the app exists so Celery's Django fix-up sees it and calls
# django.setup() in every worker process.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dipaco_server.settings")

app = Celery("dipaco_server")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
