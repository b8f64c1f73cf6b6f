"""Round.first_round: the first round's settlement over whole units."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("rounds", "0011_contribution_replica_sketch"),
    ]

    operations = [
        migrations.AddField(
            model_name="round",
            name="first_round",
            field=models.JSONField(blank=True, null=True),
        ),
    ]
