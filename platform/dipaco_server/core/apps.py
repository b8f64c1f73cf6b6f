from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "dipaco_server.core"
    label = "core"
    verbose_name = "dipaco core"
