"""Runs: datasets, runs and their state machine, modules and their versions, paths, metrics."""
