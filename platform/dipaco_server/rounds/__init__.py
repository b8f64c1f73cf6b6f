"""Rounds: outer rounds, their work units, the leases that hand units out, and contributions."""
