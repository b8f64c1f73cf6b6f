"""The inference API's contract: manifests whose URLs serve what they say, round selection,
public versus staff reads, and a clear 4xx in the one error shape for every refusal."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.test import Client
from safetensors.torch import load as safetensors_load

from dipaco.inference import export_state
from dipaco_server.inference.routing import MAX_TEXT_CHARS
from tests.test_inference import publish, run_cli, served, trained

__all__ = ["served"]  # a fixture these tests use


def _error(response: Any, status: int, code: str) -> str:
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"} and body["error"]["code"] == code
    assert body["error"]["message"]
    return str(body["error"]["message"])


def test_the_manifest_lists_files_and_modules_with_urls_that_serve_those_bytes(
    served: str,
) -> None:
    t = trained()
    run = publish(t)
    manifest = httpx.get(f"{served}/api/v1/runs/{run.pk}/paths/0/manifest").json()
    assert manifest["round"] == 1 and manifest["folder"] == "infer-path-0-round-2"  # counted from 1
    assert manifest["path"]["modules"] == ["0.0", "1.0", "shared"]
    assert [m["version"] for m in manifest["modules"]] == [2, 2, 2]
    names = [f["name"] for f in manifest["files"]]
    assert names == sorted(names) and "model.safetensors" in names and "README.md" in names
    for item in manifest["files"] + manifest["modules"]:
        response = httpx.get(item["url"], follow_redirects=True)
        assert response.status_code == 200, item
        assert len(response.content) == item["size"]
        assert hashlib.sha256(response.content).hexdigest() == item["sha256"]


def test_a_round_serves_the_weights_after_it_and_the_default_the_last_round(
    db: None, client: Client
) -> None:
    t = trained()
    run = publish(t)
    for query, round_ in (("?round=0", 0), ("?round=1", 1), ("", 1)):
        response = client.get(f"/api/v1/runs/{run.pk}/paths/3/download{query}")
        assert response.status_code == 200
        archive = zipfile.ZipFile(io.BytesIO(b"".join(response.streaming_content)))
        weights = safetensors_load(
            archive.read(f"infer-path-3-round-{round_ + 1}/model.safetensors")
        )
        expected = export_state(t.config, 3, t.versions[round_ + 1])  # round t wrote v(t + 1)
        assert weights.keys() == expected.keys()
        assert all(weights[name].equal(expected[name]) for name in expected)


def test_it_refuses_unknown_runs_paths_and_files_with_404(db: None, client: Client) -> None:
    run = publish(trained())
    _error(client.get("/api/v1/runs/999999/paths/0/manifest"), 404, "run_not_found")
    message = _error(client.get(f"/api/v1/runs/{run.pk}/paths/4/manifest"), 404, "path_not_found")
    assert "0..3" in message
    _error(
        client.post("/api/v1/runs/999999/route", {"text": "x"}, "application/json"),
        404,
        "run_not_found",
    )
    response = client.get(f"/api/v1/runs/{run.pk}/paths/0/files/weights.bin")
    assert "model.safetensors" in _error(response, 404, "file_not_found")


def test_it_refuses_a_path_with_no_trained_version_with_409(db: None, client: Client) -> None:
    from dipaco_server.runs.services import create_run

    t = trained()
    empty = create_run("empty", t.config.model_dump(mode="json") | {"name": "empty"})
    for route in ("manifest", "download"):
        _error(client.get(f"/api/v1/runs/{empty.pk}/paths/0/{route}"), 409, "path_not_trained")
    initial = publish(t, versions=1, name="initial")
    message = _error(
        client.get(f"/api/v1/runs/{initial.pk}/paths/0/manifest"), 409, "path_not_trained"
    )
    assert "once its first round has closed" in message  # its initial weights are not served
    response = client.get(f"/api/v1/runs/{initial.pk}/paths/0/manifest?round=0")
    _error(response, 409, "path_not_trained")


def test_it_refuses_a_round_past_the_newest_weights(db: None, client: Client) -> None:
    run = publish(trained())
    url = f"/api/v1/runs/{run.pk}/paths/1/manifest"
    assert "from 0 to 1" in _error(client.get(f"{url}?round=2"), 404, "round_not_found")
    _error(client.get(f"{url}?round=-1"), 422, "invalid_request")


def test_it_refuses_routing_texts_that_are_empty_or_too_long(db: None, client: Client) -> None:
    from dipaco_server.runs.services import create_run

    t = trained()
    run = publish(t)
    url = f"/api/v1/runs/{run.pk}/route"

    def post(text: str) -> Any:
        return client.post(url, {"text": text}, content_type="application/json")

    # The schema says it (min/max length, not only spaces): refused as invalid requests.
    assert "body.text" in _error(post("  \n"), 422, "invalid_request")
    message = _error(post("a" * (MAX_TEXT_CHARS + 1)), 422, "invalid_request")
    assert str(MAX_TEXT_CHARS) in message
    _error(post("a" * 300_000), 413, "body_too_large")
    assert post(t.train_docs[0].text).status_code == 200
    unprepared = create_run("unprepared", t.config.model_dump(mode="json") | {"name": "unprepared"})
    response = client.post(
        f"/api/v1/runs/{unprepared.pk}/route", {"text": "hello"}, content_type="application/json"
    )
    assert "tokenizer" in _error(response, 409, "run_not_prepared")


def test_downloads_and_routing_need_a_staff_token_when_public_read_is_off(
    db: None, client: Client, settings: Any
) -> None:
    from dipaco_server.accounts.services import create_api_token, create_user

    run = publish(trained())
    settings.DIPACO_PUBLIC_READ = False
    manifest = f"/api/v1/runs/{run.pk}/paths/0/manifest"
    route = f"/api/v1/runs/{run.pk}/route"
    _error(client.get(manifest), 401, "unauthenticated")
    _error(client.get(manifest, HTTP_AUTHORIZATION="Bearer dpa_wrong"), 401, "token_invalid")
    _error(client.post(route, {"text": "x"}, "application/json"), 401, "unauthenticated")
    user, _ = create_user("operator", staff=True)
    _, token = create_api_token(user)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    assert client.get(manifest, **auth).status_code == 200
    assert client.post(route, {"text": "ship"}, "application/json", **auth).status_code == 200
    settings.DIPACO_PUBLIC_READ = True
    assert client.get(manifest).status_code == 200


def test_the_cli_says_why_the_server_refused_and_exits_1(
    served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = publish(trained())
    argv = ("--server", served, "--run", str(run.pk))
    assert run_cli("download", *argv, "--path", "7", "--out", str(tmp_path / "x")) == 1
    assert "has no path 7" in capsys.readouterr().err
    assert run_cli("route", *argv, "") == 1
    assert "body.text" in capsys.readouterr().err
    assert run_cli("route", *argv, "--json", "ship wave tide") == 0
    assert '"path"' in capsys.readouterr().out


def test_download_fetches_the_servers_model_when_it_assembles_other_bytes(
    served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    import dipaco.inference

    run = publish(trained())
    served_model = httpx.get(f"{served}/api/v1/runs/{run.pk}/paths/0/manifest").json()
    # As if this machine's safetensors wrote its header differently from the server's.
    monkeypatch.setattr(dipaco.inference, "model_metadata", lambda: {"format": "pt", "x": "1"})
    out = tmp_path / "fallback"
    argv = ("--server", served, "--run", str(run.pk), "--path", "0", "--out", str(out))
    assert run_cli("download", *argv) == 0
    assert "differs from the server's" in capsys.readouterr().err
    model = next(f for f in served_model["files"] if f["name"] == "model.safetensors")
    data = (out / "model.safetensors").read_bytes()
    assert hashlib.sha256(data).hexdigest() == model["sha256"]
