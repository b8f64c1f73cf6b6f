"""`dipaco demo`: the whole product on one machine, from an empty data dir to a summary.

    plan       the run config the flags describe, and the stdlib corpus sample (cached)
    control    `dipaco server` as a child process, staff and enrollment tokens, the admin API
    workers    local `dipaco-worker` processes and the events they print
    baseline   dense models of the same size from phase 2's start, on the tokens it used
    records    what the server recorded: bytes, tokens, each phase's time
    summary    perplexities of both phases, bytes, the sample; the table and the JSON
    display    the live progress panel

`dipaco_demo.cli` ties them together. Nothing here is needed to use dipaco; it shows how
the parts fit, and the cluster-mode test drives a real deployment with the same pieces.
"""
