from django.apps import AppConfig


class DipacoWebConfig(AppConfig):
    name = "dipaco_web"
    verbose_name = "dipaco dashboard"
