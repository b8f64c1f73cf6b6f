"""Limits of the HTTP server in front of the app (gunicorn), which the launcher passes on
its command line (dipaco_server.cli.server) and the API documents (dipaco_server.errors).
Imports nothing, so the launcher stays light."""

# gunicorn's largest finite --limit-request-line (its default is 4094): the longest request
# line the API's schema admits, a manifest request whose `held` lists every module of a
# 256-module path, fits with room (rounds.protocol.api.HELD_MAX_LENGTH; tests/test_server_cli.py).
REQUEST_LINE_LIMIT = 8190
