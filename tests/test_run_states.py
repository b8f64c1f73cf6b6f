"""The run state machine and run creation: every move, every refusal, every config error."""

from __future__ import annotations

import threading
from itertools import product

import pytest
from django.db import connection

from dipaco.config import OuterConfig
from dipaco_server.runs.errors import ConfigInvalid, InvalidTransition, RunNameTaken
from dipaco_server.runs.models import Run
from dipaco_server.runs.services import TRANSITIONS, create_run, transition
from tests.test_models import tiny_config

STATES = list(Run.State.values)
ALLOWED = [(a, b) for a, b in product(STATES, STATES) if b in TRANSITIONS[a]]
FORBIDDEN = [(a, b) for a, b in product(STATES, STATES) if b not in TRANSITIONS[a]]


def run_in(state: str, name: str = "r") -> Run:
    """A run row already in `state` (set directly: the machine is what is under test)."""
    return Run.objects.create(name=name, config=tiny_config(), state=state)


def test_the_machine_matches_the_documented_life_of_a_run() -> None:
    assert TRANSITIONS["draft"] == ("preparing", "cancelled")
    assert "paused" in TRANSITIONS["running"] and "running" in TRANSITIONS["paused"]
    assert all(not TRANSITIONS[end] for end in ("finished", "failed", "cancelled"))
    assert set(TRANSITIONS) == set(STATES)


@pytest.mark.parametrize(("start", "to"), ALLOWED)
def test_every_allowed_transition_works(db: None, start: str, to: str) -> None:
    run = transition(run_in(start), to)
    assert run.state == to
    assert Run.objects.get(pk=run.pk).state == to


@pytest.mark.parametrize(("start", "to"), FORBIDDEN)
def test_every_forbidden_transition_is_refused_naming_the_allowed_moves(
    db: None, start: str, to: str
) -> None:
    run = run_in(start)
    with pytest.raises(InvalidTransition) as refused:
        transition(run, to)
    allowed = list(TRANSITIONS[start])
    assert refused.value.details["allowed"] == allowed
    assert all(move in refused.value.message for move in allowed)
    if not allowed:
        assert "final" in refused.value.message
    assert Run.objects.get(pk=run.pk).state == start


def test_an_unknown_state_is_refused(db: None) -> None:
    with pytest.raises(InvalidTransition, match="not a run state"):
        transition(run_in("running"), "sleeping")


def test_the_check_reads_the_database_not_a_stale_copy(db: None) -> None:
    run = run_in("running")
    stale = Run.objects.get(pk=run.pk)
    transition(run, "paused")
    with pytest.raises(InvalidTransition, match="is paused"):
        transition(stale, "paused")  # stale.state still says running


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_transitions_from_one_state_cannot_both_win() -> None:
    run = run_in("running")
    barrier, outcomes = threading.Barrier(2), []

    def pause() -> None:
        try:
            barrier.wait()
            transition(Run.objects.get(pk=run.pk), "paused")
            outcomes.append("won")
        except InvalidTransition:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=pause) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(outcomes) == ["refused", "won"]


def test_timestamps_and_error_follow_the_state(db: None) -> None:
    run = run_in("ready")
    transition(run, "running")
    started = run.started_at
    assert started is not None and run.finished_at is None
    transition(run, "paused")
    transition(run, "running")
    assert run.started_at == started, "resuming must not move the start time"
    transition(run, "failed", error="outer step of module 0.1 raised")
    assert run.finished_at is not None
    assert run.error == "outer step of module 0.1 raised"


def test_create_run_stores_the_config_whole_with_defaults_filled(db: None) -> None:
    run = create_run("whole", {"rounds": 7})
    assert run.config["rounds"] == 7 and run.config["name"] == "whole"
    assert run.config["outer"]["lr"] == OuterConfig().lr  # the default, written down
    assert run.modules.count() == len(run.run_config.module_param_counts())


def test_an_invalid_config_is_refused_naming_each_field(db: None) -> None:
    config = tiny_config()
    config["rounds"] = 0
    config["model"]["num_heads"] = 5  # does not divide hidden_size 128
    with pytest.raises(ConfigInvalid) as refused:
        create_run("bad", config)
    fields = {problem["field"] for problem in refused.value.details["problems"]}
    assert {"rounds", "model.num_heads"} <= fields
    assert "model.num_heads" in refused.value.message
    assert not Run.objects.filter(name="bad").exists()


def test_an_unknown_setting_is_refused_by_name(db: None) -> None:
    with pytest.raises(ConfigInvalid) as refused:
        create_run("typo", {**tiny_config(), "inner": {"stpes": 5}})
    assert refused.value.details["problems"][0]["field"] == "inner.stpes"


def test_a_config_naming_another_run_is_refused(db: None) -> None:
    with pytest.raises(ConfigInvalid, match="differs from the run name"):
        create_run("mine", {**tiny_config(), "name": "theirs"})


def test_a_taken_run_name_is_refused(db: None) -> None:
    create_run("taken", tiny_config())
    with pytest.raises(RunNameTaken, match="choose another name"):
        create_run("taken", tiny_config())
