"""An append-only log of what staff did through the admin API and the dashboard."""
