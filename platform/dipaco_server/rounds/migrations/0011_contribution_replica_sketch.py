# Each compared replica copy keeps its difference from the other copy, sketched
# (rounds.persistence), and the other copy's worker: the evidence of what its worker
# keeps adding.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("rounds", "0010_round_closing_started_at"),
        ("workers", "0002_trust"),
    ]

    operations = [
        migrations.AddField(
            model_name="contribution",
            name="replica_partner",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to="workers.worker",
            ),
        ),
        migrations.AddField(
            model_name="contribution",
            name="replica_sketch",
            field=models.BinaryField(blank=True, null=True),
        ),
    ]
