"""Verification, in one home: every acceptance check of an outer step (docs/design.md §7).

- ``rules``: the checks on one module's Δs as pure functions, and ``persistence``: the
  fixed-direction bias a worker's copies keep adding; neither imports Django, so
  bench/attacks.py runs the very rules the server applies;
- ``replication``: the sampled check copies a lease may be (some units trained twice);
- ``arrival`` (each Δ's own checks at its completion, the check_unit task, reused by the
  step), ``uploads`` (the format check), ``context`` (what the checks compare against), ``scorer``
  (proof of useful work), ``checks`` (every check in order: `check_contributions`) and
  ``credit`` (what the verdicts do to trust and credit: `settle`).

The outer step (rounds.outer.step) calls one entry point, ``judge`` (`judge`, which runs
`check_contributions` on what the database holds, before it aggregates; `settle` inside
its commit): it reads fetch, judge, aggregate, Nesterov step, publish. This package imports none of its modules, so that importing
the rules needs no Django settings.
"""
