from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "dipaco_server.runs"
    label = "runs"
    verbose_name = "dipaco runs"
