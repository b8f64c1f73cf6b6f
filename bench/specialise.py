"""How much DiPaCo's paths specialise, and what re-routing while reading buys (bench/quality.py).

Every validation window of the run's sample is scored on every path, token by token:
  routed        each window on the path its document was routed to: the run's routed loss,
                the router reading each document's first tokens once (route once);
  rerouted      the window cut into chunks of k tokens: the first on the document's path,
                chunk j on the path the router picks from the window's last
                ``router.prefix_tokens`` tokens before it (the DiPaCo paper re-routes every
                64 tokens while generating); each chunk's tokens are scored by that path
                with the whole window before them as context (a fresh prefill);
  oracle        each window on whichever path scores it best, chosen after seeing the loss:
                the bound on any router at once-per-window routing (bench/router_gap.py);
  oracle_chunks the same per chunk of k tokens: the bound on any re-routing router;
  agreement     how often the router's path is the oracle's (chance: 1 / paths).
  discriminative  the paper's discriminative router, fitted after training: a ridge
                regression from the router's features of a window's first tokens to each
                path's loss on the window (the penalty by leave-one-out), routing to the
                least predicted; fitted on half of each path's windows and scored on the
                other half, then the reverse, beside the k-means router reading the same
                tokens (window-level routing, both: a window's document is not kept).
Per domain (the standard library's top-level packages, or the corpus's top-level folders):
each validation document's first window, routed as sharding routed it, on every path: the
routed and oracle loss per domain, and how much of each domain goes to its most frequent
path (purity; 1 / paths when routing ignores the domain).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

import torch
import torch.nn.functional as F

from dipaco.config import RunConfig
from dipaco.data.corpus import CorpusStats
from dipaco.evaluate import EVAL_BATCH, ValWindows
from dipaco.model import build_model
from dipaco.modular import assemble_path_state
from dipaco.simulate import DataBudget, PreparedData
from dipaco.simulate.prepare import select_documents

Modules = dict[str, dict[str, torch.Tensor]]
MIN_DOMAIN_DOCS = 8  # a domain with fewer validation documents joins "other"


def token_losses(
    config: RunConfig, modules: Modules, windows: torch.Tensor, device: str = "cpu"
) -> torch.Tensor:
    """(paths, n, T) float32 on the CPU: each target's cross-entropy on each path."""
    model = build_model(config.model, config.seed).to(device).eval()
    out = []
    with torch.no_grad():
        for q in range(config.num_paths):
            model.load_state_dict(assemble_path_state(config, q, modules))
            rows = []
            for start in range(0, windows.shape[0], EVAL_BATCH):
                batch = windows[start : start + EVAL_BATCH].to(device)  # (B, T+1)
                logits = model(input_ids=batch[:, :-1]).logits.float()  # (B, T, V)
                loss = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
                rows.append(loss.cpu())
            out.append(torch.cat(rows))  # (n, T)
    return torch.stack(out)


def reroute_paths(
    data: PreparedData, windows: torch.Tensor, routed_to: torch.Tensor, every: int
) -> torch.Tensor:
    """(n, chunks): the path of each chunk of `every` targets; chunk 0 keeps the document's
    path, chunk j the router's pick from the window's tokens before it."""
    assert data.router is not None
    chunks = math.ceil((windows.shape[1] - 1) / every)
    paths = routed_to[:, None].repeat(1, chunks)  # (n, chunks)
    for j in range(1, chunks):
        picked = data.router.route_tails(windows[:, : j * every].tolist())
        paths[:, j] = torch.tensor(picked)
    return paths


def window_figures(
    config: RunConfig,
    data: PreparedData,
    modules: Modules,
    windows: ValWindows,
    every: int,
    device: str = "cpu",
) -> dict[str, Any]:
    """routed, rerouted, oracle and oracle_chunks losses and the router's agreement."""
    every_window = torch.cat(windows.per_path)  # (n, T+1), path 0's windows first
    routed_to = torch.cat(
        [torch.full((w.shape[0],), p, dtype=torch.long) for p, w in enumerate(windows.per_path)]
    )  # (n,)
    losses = token_losses(config, modules, every_window, device).double()  # (P, n, T)
    paths, n, seq = losses.shape
    per_window = losses.mean(2)  # (P, n)
    routed = float(per_window.gather(0, routed_to[None]).mean())
    chunk_paths = reroute_paths(data, every_window, routed_to, every)  # (n, chunks)
    position_paths = chunk_paths.repeat_interleave(every, dim=1)[:, :seq]  # (n, T)
    rerouted = float(losses.gather(0, position_paths[None]).mean())
    chunked = losses.reshape(paths, n, -1, every) if seq % every == 0 else None
    oracle_chunks = float(chunked.mean(3).min(0).values.mean()) if chunked is not None else None
    switched = (chunk_paths != chunk_paths[:, :1]).any(1)
    oracle = float(per_window.min(0).values.mean())
    halves = torch.cat([(torch.arange(w.shape[0]) * 2 >= w.shape[0]) for w in windows.per_path])
    return {
        "discriminative": discriminative_figures(data, every_window, per_window, halves),
        "paths": paths,
        "windows": n,
        "reroute_every": every,
        "routed_loss": routed,
        "rerouted_loss": rerouted,
        "reroute_vs_route_once": math.exp(rerouted - routed),
        "windows_rerouted": float(switched.double().mean()),
        "oracle_loss": oracle,
        "oracle_vs_routed": math.exp(oracle - routed),
        "oracle_chunks_loss": oracle_chunks,
        "router_agreement": float((per_window.argmin(0) == routed_to).double().mean()),
        "chance_agreement": 1 / paths,
        "single_path_loss": float(per_window.mean(1).min()),
    }


RIDGE_PENALTIES = tuple(10.0**k for k in range(-4, 3))


def with_bias(x: torch.Tensor) -> torch.Tensor:
    """(n, D+1): features x (n, D) and a column of ones, as `ridge_fit`'s weights read them."""
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)


def ridge_fit(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(D+1, P) ridge weights from features x (n, D) and a bias column to targets y (n, P),
    and the penalty (x the Gram matrix's mean diagonal) of least leave-one-out error; solved
    in the dual (n x n) when there are more features than windows (a TF-IDF router's).
    Predict with ``with_bias(x) @ weights``."""
    x = with_bias(x)  # (n, D+1)
    n, dim = x.shape
    dual = dim > n
    gram = x @ x.T if dual else x.T @ x  # (n, n) or (D+1, D+1)
    scale = float(gram.diagonal().sum()) / dim
    best: tuple[float, torch.Tensor, float] | None = None
    for penalty in RIDGE_PENALTIES:
        inverse = torch.linalg.inv(gram + penalty * scale * torch.eye(gram.shape[0], dtype=x.dtype))
        if dual:
            weights = x.T @ (inverse @ y)  # (D+1, P)
            hat = (gram * inverse).sum(1)  # (n,) diag(K (K + lambda I)^-1), both symmetric
        else:
            weights = inverse @ x.T @ y  # (D+1, P)
            hat = (x @ inverse * x).sum(1)  # (n,) leverage
        loo = ((y - x @ weights) / (1 - hat).clamp_min(1e-6)[:, None]).pow(2).mean()
        if best is None or float(loo) < best[0]:
            best = (float(loo), weights, penalty)
    assert best is not None
    return best[1], best[2]


def discriminative_figures(
    data: PreparedData, windows: torch.Tensor, per_window: torch.Tensor, halves: torch.Tensor
) -> dict[str, Any]:
    """The paper's discriminative router against k-means, both routing each window by its
    first ``router.prefix_tokens`` tokens, cross-fitted on two halves of the windows
    (`halves`, (n,) bool: a path's second half of windows, mostly other documents)."""
    assert data.router is not None
    prefix = data.router.spec.prefix_tokens
    heads = windows[:, :prefix].tolist()
    x = data.router.featurizer.features(heads).double()  # (n, D)
    kmeans = torch.tensor(data.router.route_tails(heads))  # (n,)
    target = per_window.T - per_window.T.mean(1, keepdim=True)  # (n, P): relative loss
    picked = torch.empty_like(kmeans)
    penalties = []
    for fold in (False, True):
        train, test = halves != fold, halves == fold
        weights, penalty = ridge_fit(x[train], target[train])
        penalties.append(penalty)
        picked[test] = (with_bias(x[test]) @ weights).argmin(1)
    oracle_path = per_window.argmin(0)  # (n,)
    loss_of = lambda paths: float(per_window.gather(0, paths[None]).mean())  # noqa: E731
    routed, fitted, oracle = loss_of(kmeans), loss_of(picked), loss_of(oracle_path)
    return {
        "kmeans_loss": routed,
        "discriminative_loss": fitted,
        "discriminative_vs_kmeans": math.exp(fitted - routed),
        "oracle_vs_kmeans": math.exp(oracle - routed),
        "oracle_vs_discriminative": math.exp(oracle - fitted),
        "kmeans_agreement": float((kmeans == oracle_path).double().mean()),
        "discriminative_agreement": float((picked == oracle_path).double().mean()),
        "paths_used": int(picked.unique().numel()),
        "ridge_penalties": penalties,
    }


def domain_of(source: str) -> str:
    """A document's domain: the top-level package or folder of its source file."""
    head, sep, _ = source.replace("\\", "/").partition("/")
    return head if sep else "(top-level modules)"


def domain_figures(
    config: RunConfig, data: PreparedData, modules: Modules, budget: DataBudget, device: str = "cpu"
) -> dict[str, Any]:
    """Per domain: validation documents, routed and oracle loss of each one's first window,
    each path's loss, and purity (the share routed to the domain's most frequent path)."""
    assert data.router is not None
    _, val_docs = select_documents(config, budget, CorpusStats())
    seq = config.model.seq_len
    ids = data.tokenizer.encode_batch([doc.text for doc in val_docs])
    kept = [(doc, row) for doc, row in zip(val_docs, ids, strict=True) if len(row) > seq]
    if not kept:
        return {"documents": 0}
    routed_to = torch.tensor(data.router.route_batch([doc.text for doc, _ in kept]))
    firsts = torch.tensor([row[: seq + 1] for _, row in kept], dtype=torch.long)  # (N, T+1)
    per_doc = token_losses(config, modules, firsts, device).double().mean(2)  # (P, N)
    counts = Counter(domain_of(doc.source) for doc, _ in kept)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, (doc, _) in enumerate(kept):
        name = domain_of(doc.source)
        groups[name if counts[name] >= MIN_DOMAIN_DOCS else "other"].append(i)
    domains = {}
    for name, members in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        index = torch.tensor(members)
        picked = routed_to[index]
        share = Counter(picked.tolist())
        domains[name] = {
            "documents": len(members),
            "routed_loss": float(per_doc[:, index].gather(0, picked[None]).mean()),
            "oracle_loss": float(per_doc[:, index].min(0).values.mean()),
            "path_losses": [float(v) for v in per_doc[:, index].mean(1)],
            "routed_share": [share.get(p, 0) / len(members) for p in range(per_doc.shape[0])],
            "purity": max(share.values()) / len(members),
        }
    weights = sum(d["documents"] for d in domains.values())
    return {
        "documents": len(kept),
        "purity": sum(d["purity"] * d["documents"] for d in domains.values()) / weights,
        "domains": domains,
    }
