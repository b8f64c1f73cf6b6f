"""Contribution.agreed_with: the other copy's worker when the two agreed, kept so that a
unit counts as probation's evidence only once every Δ of it is accepted."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("rounds", "0013_round_first_round"),
        ("workers", "0004_held_credit"),
    ]

    operations = [
        migrations.AddField(
            model_name="contribution",
            name="agreed_with",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to="workers.worker",
            ),
        ),
    ]
