"""What the worker protocol tells the round's life, without importing it (the protocol sits
below it: tests/test_layers.py).

Receivers (rounds.lifecycle.receivers) are connected when the app is ready
(RoundsConfig.ready) and run in the sender's thread, after its transaction committed.
"""

from django.dispatch import Signal

# round_=: a lease of this Round was completed, its contributions recorded (sent on commit
# by rounds.protocol.api.complete_lease). The round's life closes the round if that made it
# ready (rounds.lifecycle.receivers.close_if_ready).
lease_completed = Signal()

# lease=: a Lease was granted (sent on commit by rounds.protocol.grant). The round's life
# scores its unit's base losses while it trains (rounds.lifecycle.receivers).
lease_granted = Signal()
