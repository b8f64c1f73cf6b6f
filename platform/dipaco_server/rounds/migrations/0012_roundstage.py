# Each round's stages (data cutting, fetch and decode, checks, scoring, outer step,
# publishing, evaluation): wall span and summed task seconds (rounds.stages).

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("rounds", "0011_contribution_replica_sketch"),
    ]

    operations = [
        migrations.CreateModel(
            name="RoundStage",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("stage", models.CharField(max_length=32)),
                ("started_at", models.DateTimeField()),
                ("ended_at", models.DateTimeField()),
                ("seconds", models.FloatField(default=0.0)),
                ("tasks", models.PositiveIntegerField(default=0)),
                (
                    "round",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="stages",
                        to="rounds.round",
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(fields=("round", "stage"), name="round_stage_once")
                ],
            },
        ),
    ]
