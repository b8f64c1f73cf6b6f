"""POST /api/v1/runs/{id}/generate: re-routing every k tokens through the API, a fixed seed,
bounds refused with a 4xx naming the field, anonymous only while DIPACO_PUBLIC_READ is on.
(Its rate limit is tests/test_rate_limits.py's, with the other costly public routes.)"""

from __future__ import annotations

from typing import Any

from django.test import Client

from tests.test_generation import crossing
from tests.test_inference import publish, trained


def _post(client: Client, run: Any, **body: Any) -> Any:
    return client.post(f"/api/v1/runs/{run.pk}/generate", body, content_type="application/json")


def test_a_prompt_that_turns_to_another_topic_changes_path_when_re_routed(
    db: None, client: Client
) -> None:
    t = trained()
    run = publish(t)
    prompt, first_path, second_path = crossing(t)
    once = _post(client, run, text=prompt, max_new_tokens=8)
    assert once.status_code == 200, once.content
    body = once.json()
    assert body["routed"] and body["path"] == first_path and body["paths"] == [first_path]
    assert body["switches"] == [] and body["reroute_every"] == 0 and body["tokens"] >= 1
    rerouted = _post(client, run, text=prompt, max_new_tokens=8, reroute_every=4).json()
    assert rerouted["switches"][0] == {"at": 4, "from_path": first_path, "to_path": second_path}
    assert rerouted["paths"][:2] == [first_path, second_path]
    assert "".join(s["text"] for s in rerouted["segments"]) == rerouted["continuation"]
    # A path asked for writes everything, as a downloaded path does.
    alone = _post(client, run, text=prompt, max_new_tokens=8, reroute_every=4, path=second_path)
    assert alone.json()["paths"] == [second_path] and not alone.json()["routed"]


def test_a_seed_gives_the_same_text_and_bad_bounds_are_refused_with_422(
    db: None, client: Client, settings: Any
) -> None:
    run = publish(trained())
    sampled = {"text": "ship wave tide", "max_new_tokens": 12, "temperature": 1.5}
    first = _post(client, run, seed=3, reroute_every=4, **sampled).json()
    again = _post(client, run, seed=3, reroute_every=4, **sampled).json()
    assert first["continuation"] == again["continuation"] and first["segments"] == again["segments"]
    for bad in ({"max_new_tokens": 0}, {"max_new_tokens": 10_000}, {"reroute_every": -1},
                {"temperature": 3}, {"text": "   "}):  # fmt: skip
        response = _post(client, run, **({"text": "ship"} | bad))
        assert response.status_code == 422, (bad, response.content)
        assert next(iter(bad)) in response.json()["error"]["message"]
    settings.DIPACO_PUBLIC_READ = False
    assert _post(client, run, text="ship").status_code == 401


def test_try_it_shows_where_the_path_changed(db: None, client: Client, settings: Any) -> None:
    settings.DIPACO_GENERATE_MAX_NEW_TOKENS = 16
    t = trained()
    run = publish(t)
    prompt, first_path, second_path = crossing(t)
    url = f"/runs/{run.pk}/paths/{first_path}/generate/"
    page = client.get(f"/runs/{run.pk}/paths/{first_path}/").content.decode()
    assert 'name="reroute_every"' in page
    html = client.post(url, {"prompt": prompt, "reroute_every": "8"}).content.decode()
    assert f'data-routed-path="{first_path}"' in html and "re-routing every 8 tokens" in html
    assert f"after 8 new tokens, path {first_path} → {second_path}" in html
    assert f'data-segment-path="{second_path}"' in html
    once = client.post(url, {"prompt": prompt, "reroute_every": "0"}).content.decode()
    assert "data-switches" not in once and f'data-segment-path="{second_path}"' not in once
    refused = client.post(url, {"prompt": prompt, "reroute_every": "5"})
    assert refused.status_code == 422 and "re-route every" in refused.content.decode()
