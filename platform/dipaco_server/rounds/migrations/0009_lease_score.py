# The unit's whole-Δ score, computed once per round by the first module step that scores it
# and reused by the steps of the path's other modules (rounds.outer_step.Scorer).

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("rounds", "0008_contribution_base_version"),
    ]

    operations = [
        migrations.AddField(
            model_name="lease",
            name="score",
            field=models.JSONField(blank=True, null=True),
        ),
    ]
