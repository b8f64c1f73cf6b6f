from django.apps import AppConfig


class RoundsConfig(AppConfig):
    name = "dipaco_server.rounds"
    label = "rounds"
    verbose_name = "dipaco rounds"
