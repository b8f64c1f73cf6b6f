"""Lease.base_losses: the unit's base losses on its scored windows, computed while it trains
(rounds.verification.unit_score.score_granted) and reused by its score at completion."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("rounds", "0015_contribution_arrival_check"),
    ]

    operations = [
        migrations.AddField(
            model_name="lease",
            name="base_losses",
            field=models.JSONField(blank=True, null=True),
        ),
    ]
