"""The browser dashboard of the dipaco control plane (templates and static files)."""
