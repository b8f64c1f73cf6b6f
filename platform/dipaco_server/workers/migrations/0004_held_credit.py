"""Credit held while on probation (Worker.held_units, held_tokens): existing workers hold
none."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workers", "0003_probation"),
    ]

    operations = [
        migrations.AddField(
            model_name="worker",
            name="held_units",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="worker",
            name="held_tokens",
            field=models.PositiveBigIntegerField(default=0),
        ),
    ]
