from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "dipaco_server.inference"
    label = "inference"
    verbose_name = "dipaco inference"
