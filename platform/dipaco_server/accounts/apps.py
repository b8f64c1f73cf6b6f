from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "dipaco_server.accounts"
    label = "accounts"
    verbose_name = "dipaco accounts"

    def ready(self) -> None:
        # Connects the sign-in throttle's signal receivers (failures counted, success clears);
        # imported here, as Django wants, once every app's models are loaded.
        from dipaco_server.accounts import throttle  # noqa: F401
