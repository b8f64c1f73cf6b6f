"""dipaco.generation: re-routing every k tokens follows the text so far; a seed fixes the tokens.

The paths and router are test_inference's (four topics with their own words, 2x2 paths).
A prompt that starts on one topic and turns to another is routed once to the first topic's
path (the router reads a document's first tokens); re-routing reads the last tokens, so the
continuation moves to the second topic's path.
"""

from __future__ import annotations

import random

import pytest
import torch

from dipaco.generation import generate, sample_next
from dipaco.model import build_model
from dipaco.modular import assemble_path_state
from tests.test_inference import TOPICS, Trained, trained


def topic_text(topic: str, words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(TOPICS[topic]) for _ in range(words))


def crossing(t: Trained) -> tuple[str, int, int]:
    """A prompt that turns from one topic to another, with the two topics' paths."""
    router = t_router(t)
    routes = {topic: router.route(topic_text(topic, 60, 0)) for topic in TOPICS}
    first, second = next(
        (a, b) for a in routes for b in routes if routes[a] != routes[b]
    )  # two topics the router tells apart
    prompt = topic_text(first, 40, 1) + " " + topic_text(second, 40, 2)
    return prompt, routes[first], routes[second]


def t_router(t: Trained) -> object:
    import tempfile
    from pathlib import Path

    from dipaco.routing.router import Router

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "router.safetensors").write_bytes(t.router_file)
        return Router.load(Path(tmp) / "router.safetensors", t.tokenizer)


def opener(t: Trained) -> object:
    models: dict[int, torch.nn.Module] = {}

    def open_path(p: int) -> torch.nn.Module:
        if p not in models:
            model = build_model(t.config.model, 0)
            model.load_state_dict(assemble_path_state(t.config, p, t.versions[-1]))
            models[p] = model.eval()
        return models[p]

    return open_path


def test_re_routing_moves_a_continuation_that_crosses_topics_to_the_second_path() -> None:
    t = trained()
    router = t_router(t)
    prompt, first_path, second_path = crossing(t)
    assert router.route(prompt) == first_path  # routed once: the first topic's path
    ids = [t.tokenizer.separator_id, *t.tokenizer.encode(prompt)]
    once = generate(opener(t), ids, first_path, 12)
    assert once.paths == [first_path] and once.switches == []
    rerouted = generate(
        opener(t), ids, first_path, 12, route_tail=router.route_tail, reroute_every=4
    )
    assert rerouted.routes[0] == first_path and rerouted.routes[1] == second_path
    assert rerouted.switches[0] == {"at": 4, "from_path": first_path, "to_path": second_path}
    assert rerouted.segments[0].end == 4 and len(rerouted.tokens) == 12
    # the first chunk is the route-once continuation's first tokens, on the same path
    assert rerouted.tokens[:4] == once.tokens[:4]


def test_a_seed_gives_the_same_tokens_and_another_seed_others() -> None:
    t = trained()
    router = t_router(t)
    prompt, first_path, _ = crossing(t)
    ids = [t.tokenizer.separator_id, *t.tokenizer.encode(prompt)]

    def sample(seed: int) -> list[int]:
        torch.manual_seed(seed + 1000)  # the global generator must not matter
        return generate(
            opener(t), ids, first_path, 16, route_tail=router.route_tail, reroute_every=4,
            temperature=1.5, seed=seed,
        ).tokens  # fmt: skip

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_sampling_is_greedy_at_zero_and_bad_arguments_are_refused() -> None:
    logits = torch.tensor([0.1, 3.0, 0.2])
    assert sample_next(logits, 0.0, 50, torch.Generator().manual_seed(0)) == 1
    t = trained()
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(opener(t), [1], 0, 0)
    with pytest.raises(ValueError, match="reroute_every"):
        generate(opener(t), [1], 0, 4, reroute_every=-1)
    with pytest.raises(ValueError, match="empty"):
        generate(opener(t), [], 0, 4)
