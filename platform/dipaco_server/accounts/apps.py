from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "dipaco_server.accounts"
    label = "accounts"
    verbose_name = "dipaco accounts"
