"""The project's settings with short leases and a fast beat, for tests/test_faults.py.

A worker killed mid-unit holds its lease until the lease times out; the fault tests need that
to take seconds, not the production minutes, so the sweep runs every second as well; the same
for a round whose outer steps died with a whole Celery worker.
"""

from dipaco_server.settings import *  # noqa: F403

DIPACO_LEASE_TIMEOUT_S = 8
# A round whose outer steps the broker lost (a Celery worker killed whole) is re-sent after this.
DIPACO_ROUND_CLOSE_RETRY_S = 10
# Blob retention (issue 19) keeps its own pace: it is not what these tests exercise.
CELERY_BEAT_SCHEDULE = {
    name: {**entry, "schedule": entry["schedule"] if name == "sweep-blobs" else 1.0}
    for name, entry in CELERY_BEAT_SCHEDULE.items()  # noqa: F405
}
