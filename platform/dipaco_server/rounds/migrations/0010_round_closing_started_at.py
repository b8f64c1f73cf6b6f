# When a round began closing, apart from closing_at (when close_round last sent its outer
# steps): beat's stalled-round sweep moves closing_at when it sends them again, and the lease
# view's expected opening (closing start + the last outer step's length) read that as the
# start, so a step slower than DIPACO_ROUND_CLOSE_RETRY_S looked short to the next round.

from django.db import migrations, models
from django.db.models import F


def backfill(apps, schema_editor):  # type: ignore[no-untyped-def]
    Round = apps.get_model("rounds", "Round")
    Round.objects.filter(closing_started_at__isnull=True).update(
        closing_started_at=F("closing_at")
    )


class Migration(migrations.Migration):
    dependencies = [
        ("rounds", "0009_lease_score"),
    ]

    operations = [
        migrations.AddField(
            model_name="round",
            name="closing_started_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]
