"""Hostile input (issue 11): each case is refused with a clear 4xx or a recorded rejection.

This docstring is the index: every case of the issue, and the test that covers it. Tests
named ``here`` are in this module; the others already existed and are not repeated.

=========================================  =====================================================
case                                       test
=========================================  =====================================================
upload with NaN                            test_outer_tasks::test_closing_a_round_rejects_nan_
                                           and_misshapen_uploads_and_steps_like_the_library
                                           (Celery worker, S3); codecs: test_codecs::
                                           test_it_rejects_non_finite_values_and_bad_scales
upload with Inf, wrong dtype, truncated,   here: test_hostile_uploads_are_recorded_rejections_
malformed header, a pickle (torch.save     and_the_round_steps_with_the_honest_one (outer step:
zip and raw pickles), oversized            recorded Contribution.status "rejected" + reason,
                                           counted against the worker, never unpickled); codecs:
                                           test_codecs::test_it_rejects_truncated_files,
                                           ::test_it_refuses_pickles, ::test_it_rejects_headers_
                                           that_are_not_a_json_object, ::test_it_rejects_
                                           absurd_header_lengths_without_allocating_them
upload of the wrong shape                  test_outer_tasks (as NaN above), test_codecs::
                                           test_it_rejects_uploads_that_do_not_match_the_module
upload whose bytes differ from the report  test_outer_tasks::test_uploads_that_differ_from_
(checksum), missing, or a norm outlier     their_report_or_stand_out_by_norm_are_rejected
oversized upload at the door (PUT/POST)    test_blobstore_local::test_it_refuses_an_oversized_
                                           put_with_413_and_stores_nothing (and _post_), ::test_
                                           the_size_limit_counts_bytes_read_not_the_declared_
                                           length; at complete: test_input_bounds::test_a_
                                           completion_whose_upload_is_missing_or_another_size_
                                           is_refused_naming_it; declared sizes: completion
                                           caps them at fp32
path traversal in a blob key / URL         test_blobstore_contract (every backend refuses
                                           "../"), test_blobstore_local::test_a_url_path_that_
                                           climbs_out_is_refused, ::test_a_symlink_inside_the_
                                           root_cannot_lead_out_of_it, ::test_any_key_that_
                                           passes_validation_stays_under_the_root (hypothesis)
path traversal in a module id or file      here: test_a_module_id_that_climbs_out_is_refused_
name                                       and_nothing_is_recorded, test_a_file_name_that_
                                           climbs_out_of_a_path_directory_is_a_json_404;
                                           worker names: test_workers_service::test_
                                           registration_refuses_bad_names_and_devices_...
forged worker / staff tokens               here: test_forged_tokens_are_401_on_every_kind_of_
                                           route; test_worker_api::test_registration_shows_a_
                                           working_token_once_... (a token with one char more)
forged lease secret, forged URL signature  test_worker_api::test_another_workers_lease_is_
                                           refused (lease_secret_invalid); test_blobstore_local
                                           ::test_it_refuses_a_forged_signature_with_403
revoked worker / staff tokens              test_worker_api::test_a_revoked_worker_is_refused_
                                           with_403, test_admin_api::test_a_revoked_token_is_
                                           refused_with_401, ::test_workers_are_listed_and_a_
                                           revoked_one_is_refused_by_the_worker_api
another audience's token                   here: test_a_token_is_refused_on_the_other_api
another worker's lease                     test_worker_api::test_another_workers_lease_is_
                                           refused (manifest, upload-urls, complete, release)
stale (expired) lease                      test_worker_api::test_an_expired_lease_is_refused_
                                           with_lease_expired
a replayed completion                      test_worker_api::test_a_replayed_completion_is_
                                           idempotent_and_a_different_one_is_409 (and the live
                                           HTTP cycle: a replay records no metric twice)
oversized / malformed JSON                 test_worker_api::test_an_oversized_body_is_413,
                                           ::test_malformed_or_incomplete_bodies_are_4xx_...
numbers past a database column's range     here: test_numbers_past_what_the_database_stores_
(found by the fuzzer: were 500s)           are_4xx_not_500
a run config sized to exhaust memory       here: test_a_run_config_sized_to_exhaust_memory_is_
                                           refused_before_anything_is_stored; test_config::
                                           test_it_refuses_a_path_too_large_for_memory_...;
                                           hypothesis: test_fuzz_codecs_config
impossible numbers (issue 34): a metric    test_input_bounds (completion metrics closed and
named val_loss, 1e308 tokens/s, configs    bounded, speeds clamped, every config field
of 1e308 s or 2^63 steps, Infinity         bounded and finite: 422 naming the field)
every endpoint, arbitrary requests         test_fuzz_api (schemathesis, no 5xx, schema-true)
=========================================  =====================================================
"""

from __future__ import annotations

import io
import json
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from django.test import Client

from dipaco import codecs
from dipaco.config import MAX_UNITS_PER_ROUND
from dipaco_server.accounts.services import create_api_token, create_user
from dipaco_server.rounds.lifecycle.tasks import finish_round
from dipaco_server.rounds.models import Contribution, Lease, Round
from dipaco_server.rounds.outer.step import step_module
from dipaco_server.runs.models import Module, Run
from dipaco_server.runs.services import record_metric
from dipaco_server.storage import get_blob_store
from dipaco_server.workers.models import Worker
from tests.test_inference import publish, trained
from tests.test_models import make_run, tiny_config
from tests.test_outer_tasks import (
    DILOCO,
    assert_same,
    closing_round,
    contribute,
    good,
    library_step,
    one_torch_thread,
    random_delta,
    running_run,
    stored_version,
)
from tests.test_worker_api import (
    Holder,
    assert_error,
    call,
    holder,
    new_worker,
    store,
)

API = "/api/v1"
# Fixtures from other modules: one torch thread (autouse), a lease holder and its store.
__all__ = ["holder", "one_torch_thread", "store"]


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    """Django's default hasher takes about a second per password on a shared CI core."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def staff(db: None) -> str:
    user, _ = create_user("ops", staff=True)
    return create_api_token(user, name="tests")[1]


def request(client: Client, method: str, path: str, token: str | None, body: Any = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    data = json.dumps(body) if body is not None else ""
    return client.generic(
        method, f"{API}{path}", data, content_type="application/json", headers=headers
    )


# --- hostile uploads: recorded rejections in the outer step ------------------------------------


class OpensAFile:
    """Unpickling this creates a file: proof, if the file appears, that something unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def torch_saved(run: Run, module_id: str, seed: int) -> bytes:
    """What a worker sends that calls torch.save on its Δ: a zip holding a pickle."""
    buffer = io.BytesIO()
    torch.save(random_delta(run, module_id, seed), buffer)
    return buffer.getvalue()


def with_inf(run: Run, module_id: str, seed: int) -> bytes:
    delta = random_delta(run, module_id, seed)
    first = next(iter(delta))
    delta[first].view(-1)[0] = 12345.0  # a marker to overwrite after encoding
    data = codecs.encode(delta, "fp32")
    return data.replace(struct.pack("<f", 12345.0), struct.pack("<f", float("inf")))


def as_float64(run: Run, module_id: str, seed: int) -> bytes:
    """A Δ of the right shapes in another dtype than the module's (fp32)."""
    delta = {k: v.double() for k, v in random_delta(run, module_id, seed).items()}
    return codecs.encode(delta, "fp32")


def truncated(run: Run, module_id: str, seed: int) -> bytes:
    data = good(run, module_id, seed)
    return data[: len(data) // 2]


def lying_header(run: Run, module_id: str, seed: int) -> bytes:
    """A header whose JSON is cut short while its length field still claims it all."""
    data = bytearray(good(run, module_id, seed))
    (length,) = struct.unpack("<Q", data[:8])
    data[8 + length // 2 : 8 + length] = b"\xff" * (length - length // 2)
    return bytes(data)


@pytest.mark.django_db
def test_hostile_uploads_are_recorded_rejections_and_the_round_steps_with_the_honest_one(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "unpickled"
    pickles = {  # protocol 0 has no magic bytes: its first 8 read as an absurd header length
        f"pickle-{protocol}": (
            (lambda r, m, s, p=protocol: pickle.dumps({"w": OpensAFile(marker)}, protocol=p)),
            "bad_header" if protocol == 0 else "not_safetensors",
        )
        for protocol in (0, 2, 5)
    }
    hostile = {
        "torch-save": (torch_saved, "not_safetensors"),
        **pickles,
        "inf": (with_inf, "non_finite"),
        "float64": (as_float64, "spec_mismatch"),
        "truncated": (truncated, "truncated"),
        "lying-header": (lying_header, "bad_header"),
        "oversized": (good, "size_mismatch"),
    }
    run = running_run(DILOCO, replicas=1 + len(hostile))
    _, honest = contribute(run, good, seed=1, name="honest")
    for seed, (name, (payload, _)) in enumerate(hostile.items(), start=2):
        contribute(run, payload, seed=seed, name=name)
    blobs = get_blob_store()
    for row in Contribution.objects.filter(lease__worker__name="oversized"):
        blobs.put_bytes(row.blob_key, blobs.get_bytes(row.blob_key) + b"\0" * 64)  # after complete
    closing_round(run)

    reports = [step_module(run.pk, module_id, 0) for module_id in ("0.0", "shared")]

    assert not marker.exists(), "an upload was unpickled"
    assert [(r["outcome"], r["accepted"], r["rejected"]) for r in reports] == [
        ("stepped", 1, len(hostile))
    ] * 2
    for module_id in ("0.0", "shared"):
        assert_same(
            stored_version(run, module_id, 1), library_step(run, module_id, [honest[module_id]])
        )
    rows = Contribution.objects.filter(unit__round__run=run).select_related("lease__worker")
    reasons = {(row.lease.worker.name, row.status, row.reason.split(":")[0]) for row in rows}
    expected = {("honest", "accepted", "")} | {
        (name, "rejected", code) for name, (_, code) in hostile.items()
    }
    assert reasons == expected
    counts = {
        w.name: (w.contributions_accepted, w.contributions_rejected) for w in Worker.objects.all()
    }
    assert counts == {"honest": (2, 0), **{name: (0, 2) for name in hostile}}

    assert finish_round(run.pk, 0) == "opened"
    assert Round.objects.get(run=run, t=0).state == Round.State.CLOSED
    assert Module.objects.get(run=run, module_id="0.0").current_version == 1


# --- names and keys ----------------------------------------------------------------------------


@pytest.mark.parametrize("module_id", ["../../etc/passwd", "0.0/../shared", "..", "0.0\x00"])
def test_a_module_id_that_climbs_out_is_refused_and_nothing_is_recorded(
    holder: Holder, module_id: str
) -> None:
    body = holder.completion()
    body["contributions"][0]["module_id"] = module_id
    refused = assert_error(holder.on("complete", body), 422, "contribution_invalid")
    assert module_id in json.dumps(refused["details"]) or "unexpected" in refused["message"]
    upload_urls = holder.on("upload-urls").json()["uploads"]
    assert all(".." not in u["key"].split("/") for u in upload_urls)
    assert Lease.objects.get(pk=holder.lease_id).state == Lease.State.ACTIVE
    assert not Contribution.objects.exists()


def test_a_file_name_that_climbs_out_of_a_path_directory_is_a_json_404(
    client: Client, db: None, settings: Any
) -> None:
    settings.DIPACO_PUBLIC_READ = True
    run = publish(trained())
    files = f"{API}/runs/{run.pk}/paths/0/files"
    assert client.get(f"{files}/config.json").status_code == 200  # the route serves files
    names = ["%2E%2E", "..%5C..%5Cconfig.json", "config.json%00", "..%2F..%2Fsettings.py"]
    for name in names:
        response = client.get(f"{files}/{name}")
        assert response.status_code == 404, (name, response.content)
        assert response.json()["error"]["code"] in {"file_not_found", "not_found"}, name


# --- tokens ------------------------------------------------------------------------------------


FORGED = [
    "",
    "dpw_" + "0" * 40,
    "dpa_" + "f" * 40,
    "x" * 5000,
    "token with spaces",
    "☃",
]


@pytest.mark.parametrize("forged", FORGED)
def test_forged_tokens_are_401_on_every_kind_of_route(
    client: Client, staff: str, forged: str
) -> None:
    worker = call(client, "POST", "/heartbeat", forged, body={})
    admin = request(client, "GET", "/runs", forged)
    assert worker.status_code == admin.status_code == 401, (worker.content, admin.content)
    for response in (worker, admin):
        assert set(response.json()) == {"error"} and response.json()["error"]["message"]
    scheme = client.get(f"{API}/runs", headers={"Authorization": f"Basic {staff}"})
    assert_error(scheme, 401, "unauthenticated")


def test_a_token_is_refused_on_the_other_api(client: Client, staff: str) -> None:
    _, worker_token = new_worker()
    assert request(client, "GET", "/runs", worker_token).status_code == 401
    assert request(client, "POST", "/enrollment-tokens", worker_token, {}).status_code == 401
    assert call(client, "POST", "/lease", staff).status_code == 401
    assert call(client, "POST", "/heartbeat", staff, body={}).status_code == 401


# --- numbers and sizes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("GET", f"/runs?offset={2**63}", None, "offset"),
        ("GET", f"/workers?offset={10**30}", None, "offset"),
        ("GET", f"/enrollment-tokens?offset={2**64}", None, "offset"),
        ("POST", "/enrollment-tokens", {"max_uses": 2**40}, "max_uses"),
        ("GET", f"/workers/{10**20}", None, "worker_id"),
        ("GET", f"/runs/{10**20}", None, "run_id"),
        ("GET", "/runs/{run}/metrics?round=" + str(10**20), None, "round"),
        ("GET", "/runs/{run}/metrics?path=" + str(10**20), None, "path"),
    ],
)
def test_numbers_past_what_the_database_stores_are_4xx_not_500(
    client: Client, staff: str, method: str, path: str, body: Any, field: str
) -> None:
    """Every integer parameter is bounded in the schema (bounds.py): refused by validation."""
    run = make_run("numbers")
    record_metric(run, "loss", 1.0, round=0)
    response = request(client, method, path.format(run=run.pk), staff, body)
    assert_names_field(assert_error(response, 422, "invalid_request"), field)


def assert_names_field(error: dict[str, Any], field: str) -> None:
    """The schema's refusal names the offending parameter, in its message and its details."""
    assert field in error["message"], error
    assert field in {str(e["loc"][-1]) for e in error["details"]["errors"]}, error


def test_a_worker_call_about_a_lease_id_past_bigint_is_404(client: Client, db: None) -> None:
    """The name is historical: the schema bounds lease_id now, so it is a 422, never a 500."""
    _, token = new_worker()
    beat = call(client, "POST", "/heartbeat", token, {"lease_id": 10**20}, secret="s")
    assert_names_field(assert_error(beat, 422, "invalid_request"), "lease_id")


@pytest.mark.parametrize(
    ("sections", "field"),
    [
        ({"replicas_per_path": 10**9}, "replicas_per_path"),
        ({"replicas_per_path": MAX_UNITS_PER_ROUND // 4 + 1}, "replicas_per_path"),
        (
            {"model": {"hidden_size": 65536, "num_heads": 512, "num_kv_heads": 512}},
            "limits.max_path_memory_bytes",
        ),
        ({"model": {"vocab_size": 10**9}}, "model.vocab_size"),  # past its own bound now
        ({"inner": {"micro_batch_size": 10**7}}, "inner.micro_batch_size"),
    ],
)
def test_a_run_config_sized_to_exhaust_memory_is_refused_before_anything_is_stored(
    client: Client, staff: str, sections: dict[str, Any], field: str
) -> None:
    config = tiny_config()
    for key, value in sections.items():  # raw JSON: tiny_config itself would refuse these
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    response = request(client, "POST", "/runs", staff, {"name": "greedy", "config": config})
    error = assert_error(response, 422, "config_invalid")
    assert field in {p["field"] for p in error["details"]["problems"]}, error
    assert not Run.objects.exists() and not Module.objects.exists()
