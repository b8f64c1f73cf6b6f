from django.apps import AppConfig


class AuditConfig(AppConfig):
    name = "dipaco_server.audit"
    label = "audit"
    verbose_name = "dipaco audit log"
