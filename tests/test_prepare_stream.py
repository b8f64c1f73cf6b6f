"""The server's streaming preparation: S3 sources behind an allow-list, pieces that resume,
shards reused by a later run, and memory that does not grow with the corpus."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client, override_settings

from tests.test_admin_api import admin, staff
from tests.test_worker_api import assert_error

__all__ = ["staff"]  # a fixture this module uses


@pytest.mark.django_db
def test_a_bucket_outside_the_allow_list_is_refused_naming_the_setting(
    client: Client, staff: str
) -> None:
    body: dict[str, Any] = {"name": "web", "source": "s3://other-bucket/fineweb/"}
    with override_settings(DIPACO_SOURCE_BUCKETS=["corpora"]):
        refused = admin(client, "POST", "/datasets", staff, body)
        error = assert_error(refused, 422, "source_bucket_not_allowed")
        assert "DIPACO_SOURCE_BUCKETS" in error["message"]
        assert error["details"]["setting"] == "DIPACO_SOURCE_BUCKETS"
        allowed = {**body, "source": "s3://corpora/fineweb/", "text_field": "content"}
        created = admin(client, "POST", "/datasets", staff, allowed)
    assert created.status_code == 201, created.content
    assert created.json()["text_field"] == "content"
    with override_settings(DIPACO_SOURCE_BUCKETS=[]):
        assert_error(
            admin(client, "POST", "/datasets", staff, {**body, "name": "x"}),
            422,
            "source_bucket_not_allowed",
        )
