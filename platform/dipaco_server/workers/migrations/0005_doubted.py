"""Doubt after a copy that neither agreed nor disagreed (Worker.doubted): existing workers
are not doubted."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workers", "0004_held_credit"),
    ]

    operations = [
        migrations.AddField(
            model_name="worker",
            name="doubted",
            field=models.BooleanField(default=False),
        ),
    ]
