from django.apps import AppConfig


class RoundsConfig(AppConfig):
    name = "dipaco_server.rounds"
    label = "rounds"
    verbose_name = "dipaco rounds"

    def ready(self) -> None:
        # Connects the receivers that open due rounds and end an ended run's leases
        # (runs.signals); imported here, as Django wants, once every app's models are loaded.
        from dipaco_server.rounds import receivers  # noqa: F401
