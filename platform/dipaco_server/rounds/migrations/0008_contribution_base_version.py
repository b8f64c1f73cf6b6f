# outer.overlap eager: the version each Δ is relative to (rounds.rebase).

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("rounds", "0007_lease_download_bytes"),
    ]

    operations = [
        migrations.AddField(
            model_name="contribution",
            name="base_version",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
    ]
