"""What rounds record, read back: a worker's contributions with the verdict on each
(``contributions``: the worker's own and staff's routes) and a run's status with its
current round and the workers on it (``run_status``, staff), and where each round's time
went (``round_stages``, staff)."""
