"""Health checks and the tasks that prove a Celery worker is alive."""
