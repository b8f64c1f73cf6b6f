"""What operators' tools read: the names of every Prometheus metric (names) and the HTTP
counts each web process keeps (http). The database's figures are rounds'
(rounds.reports.metrics), served with these at /metrics (rounds.reports.scrape); the
probes /healthz and /readyz are core's (core.probes)."""
