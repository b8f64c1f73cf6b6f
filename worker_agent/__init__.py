"""The volunteer worker agent (``dipaco-worker``). It never imports Django."""
