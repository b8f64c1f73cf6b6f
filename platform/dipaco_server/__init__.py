"""The dipaco control plane: a Django project (settings, URLs, Celery app).

Importing the Celery app here makes ``@shared_task`` bind to it whenever
Django starts, in web processes and workers alike.
"""

from dipaco_server.celery import app as celery_app

__all__ = ["celery_app"]
