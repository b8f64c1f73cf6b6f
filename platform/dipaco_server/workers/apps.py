from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "dipaco_server.workers"
    label = "workers"
    verbose_name = "dipaco workers"
