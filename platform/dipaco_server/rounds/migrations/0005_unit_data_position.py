# A unit's data is no longer a contiguous token range of its path's shard but a run of
# windows in the path's seeded shuffled order (dipaco.data.windows).

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("rounds", "0004_round_closing_at"),
    ]

    operations = [
        migrations.RenameField(
            model_name="workunit",
            old_name="data_offset",
            new_name="data_position",
        ),
        migrations.RenameField(
            model_name="workunit",
            old_name="data_length",
            new_name="data_windows",
        ),
    ]
