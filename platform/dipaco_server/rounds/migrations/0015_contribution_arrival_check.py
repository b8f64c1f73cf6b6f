"""Contribution.arrival_check: the per-Δ checks done when its completion arrived
(rounds.verification.arrival), reused by the round's outer step."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("rounds", "0014_contribution_agreed_with"),
    ]

    operations = [
        migrations.AddField(
            model_name="contribution",
            name="arrival_check",
            field=models.JSONField(blank=True, null=True),
        ),
    ]
