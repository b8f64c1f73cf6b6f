"""Probation (workers.probation): new columns. Workers that exist keep their standing: the
column's default is False, and register_worker puts new workers on probation."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workers", "0002_trust"),
    ]

    operations = [
        migrations.AddField(
            model_name="enrollmenttoken",
            name="trusted",
            field=models.BooleanField(default=False),
        ),
        migrations.AddField(
            model_name="worker",
            name="probation",
            field=models.BooleanField(default=False),
        ),
        migrations.AddField(
            model_name="worker",
            name="operator_trusted",
            field=models.BooleanField(default=False),
        ),
        migrations.AddField(
            model_name="worker",
            name="audits",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="worker",
            name="partners",
            field=models.JSONField(blank=True, default=list),
        ),
    ]
