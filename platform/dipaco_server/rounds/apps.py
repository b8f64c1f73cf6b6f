from django.apps import AppConfig


class RoundsConfig(AppConfig):
    name = "dipaco_server.rounds"
    label = "rounds"
    verbose_name = "dipaco rounds"

    def ready(self) -> None:
        # Connects the round's life to what asks it (runs.signals: open a due round, end an
        # ended run's leases; rounds.signals: close a round a completion made ready);
        # imported here, as Django wants, once every app's models are loaded.
        from dipaco_server.rounds.lifecycle import receivers  # noqa: F401

        # Answers workers.signals.state_asked: a worker's state follows from its leases.
        from dipaco_server.rounds.reports import activity  # noqa: F401
