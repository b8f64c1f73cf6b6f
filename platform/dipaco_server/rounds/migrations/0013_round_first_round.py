"""Round.first_round: the first round's settlement over whole units."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("rounds", "0012_roundstage"),
    ]

    operations = [
        migrations.AddField(
            model_name="round",
            name="first_round",
            field=models.JSONField(blank=True, null=True),
        ),
    ]
