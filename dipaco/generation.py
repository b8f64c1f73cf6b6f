"""Text generation on DiPaCo's paths, re-routing every k tokens (the DiPaCo paper).

A document is routed once, from its first ``router.prefix_tokens`` tokens, and its path
writes the continuation. With re-routing, every `reroute_every` new tokens the router reads
the last ``router.prefix_tokens`` tokens of the text so far (prompt and continuation), and
generation goes on on the path it picks, with a fresh prefill of the text so far on that
path (its KV cache starts empty; within a chunk the cache is kept). The paper re-routes
every 64 tokens, which is what lets 256 paths of 150M match a 1B dense model (11.38 vs
11.41; routing once per document gives 12.22).

The caller says how a path's model is opened and how text is routed, so the same loop runs
on the server (the run's models and router in the process), in `dipaco generate` (paths
downloaded on demand, routed through the server's API) and in tests. A model is anything
called as transformers' causal LMs are (``model(input_ids=..., past_key_values=...,
use_cache=True)`` returning ``.logits`` and ``.past_key_values``).

Sampling draws from its own torch.Generator seeded with `seed`: the same prompt, seed,
models and router give the same tokens, whatever else the process samples meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

# torch is imported inside the functions that use it: the server imports this module.

__all__ = ["Generation", "Segment", "generate", "sample_next"]

TOP_K = 50  # dipaco.inference's generation_config.json default


@dataclass(frozen=True)
class Segment:
    """New tokens [start, end) of the continuation, written by `path`."""

    path: int
    start: int
    end: int


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)  # the continuation's ids
    segments: list[Segment] = field(default_factory=list)  # consecutive runs of one path
    routes: list[int] = field(default_factory=list)  # the path picked at each routing

    @property
    def paths(self) -> list[int]:
        """The paths used, in the order they first wrote."""
        return list(dict.fromkeys(s.path for s in self.segments))

    @property
    def switches(self) -> list[dict[str, int]]:
        """Where the path changed: {"at": new-token index, "from_path", "to_path"}."""
        return [
            {"at": b.start, "from_path": a.path, "to_path": b.path}
            for a, b in zip(self.segments, self.segments[1:], strict=False)
        ]


def sample_next(logits: Tensor, temperature: float, top_k: int, generator: Any) -> int:
    """The next token from (V,) logits: argmax at temperature 0, else a draw from the
    softmax of logits / temperature over the top_k candidates."""
    # torch: the note under the imports
    import torch

    if temperature <= 0:
        return int(logits.argmax())
    values, indices = torch.topk(logits.float(), min(top_k, logits.numel()))
    probs = torch.softmax(values / temperature, dim=-1)
    choice = torch.multinomial(probs.cpu(), 1, generator=generator)
    return int(indices[int(choice)])


def _chunk(
    model: Any,
    context: Sequence[int],
    count: int,
    stop: int | None,
    draw: Callable[[Any], int],
    on_token: Callable[[int], None],
) -> list[int]:
    """Up to `count` new tokens on one model: a fresh prefill of `context`, then one token
    at a time on its KV cache (a model without one, dipaco.model's, reads the whole text
    again each token); ends early at `stop`."""
    # torch: the note under the imports
    import inspect

    # torch: the note under the imports
    import torch

    device = next(model.parameters()).device
    cached = "past_key_values" in inspect.signature(model.forward).parameters
    text = list(context)
    ids = torch.tensor([text], device=device)
    out: list[int] = []
    past = None
    with torch.no_grad():
        for _ in range(count):
            if cached:
                result = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = result.past_key_values
            else:
                result = model(input_ids=ids)
            token = draw(result.logits[0, -1])
            out.append(token)
            on_token(token)
            if token == stop:
                break
            text.append(token)
            ids = torch.tensor([[token]] if cached else [text], device=device)
    return out


def _tell(on_token: Callable[[int, int], None] | None, path: int, token: int) -> None:
    if on_token is not None:
        on_token(token, path)


def generate(
    open_path: Callable[[int], Any],
    prompt_ids: Sequence[int],
    first_path: int,
    max_new_tokens: int,
    *,
    route_tail: Callable[[list[int]], int] | None = None,
    reroute_every: int = 0,
    temperature: float = 0.0,
    top_k: int = TOP_K,
    seed: int = 0,
    stop: int | None = None,
    on_token: Callable[[int, int], None] | None = None,
) -> Generation:
    """Continue `prompt_ids` on `first_path` (the route of the prompt), re-routing every
    `reroute_every` new tokens with `route_tail` (the text so far's ids -> a path; 0 or no
    `route_tail`: never, a single path writes everything). `open_path(p)` gives path p's
    model. Generation stops after `max_new_tokens` or at the `stop` token (kept).
    `on_token(token, path)` hears each new token as it is drawn (a CLI streams them)."""
    # torch: the note under the imports
    import torch

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: generate at least 1 token")
    if reroute_every < 0:
        raise ValueError(f"reroute_every = {reroute_every}: 0 (never) or a token count")
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one token (the separator)")
    generator = torch.Generator().manual_seed(seed)

    def draw(logits: Any) -> int:
        return sample_next(logits, temperature, top_k, generator)

    every = reroute_every if route_tail is not None and reroute_every > 0 else max_new_tokens
    done = Generation(routes=[first_path])
    path = first_path
    while len(done.tokens) < max_new_tokens:
        if done.tokens:  # a chunk boundary: the router reads the text so far
            assert route_tail is not None
            path = route_tail([*prompt_ids, *done.tokens])
            done.routes.append(path)
        count = min(every, max_new_tokens - len(done.tokens))
        start = len(done.tokens)
        heard = partial(_tell, on_token, path)
        new = _chunk(open_path(path), [*prompt_ids, *done.tokens], count, stop, draw, heard)
        done.tokens.extend(new)
        if done.segments and done.segments[-1].path == path:
            done.segments[-1] = Segment(path, done.segments[-1].start, len(done.tokens))
        else:
            done.segments.append(Segment(path, start, len(done.tokens)))
        if new and new[-1] == stop:
            break
    return done
