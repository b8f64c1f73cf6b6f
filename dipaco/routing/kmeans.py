"""k-means and product k-means in torch: k-means++ seeding, Lloyd iterations,
a fixed seed, and nothing random outside one `torch.Generator`, so the same
features and seed give the same centroids.

Product k-means (DiPaCo's "one factor per level") follows product quantisation
(Jégou et al., 2011): the feature vector is cut into L contiguous sub-vectors
and level l clusters sub-vector l into K_l centroids. A path is one centroid per
level, and its squared distance to a document is the sum of the per-level
distances, i.e. the distance to the concatenated centroid. Running L k-means on
the *full* features with different seeds would find the same clusters L times:
the factors would be nearly identical, so most of the K_0 x K_1 combinations
would stay empty. Disjoint sub-vectors give each level a different view of the
document and spread documents over the grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class KMeansResult:
    centroids: torch.Tensor  # (K, D) float64
    labels: torch.Tensor  # (N,) int64
    inertia: float  # sum of squared distances to the assigned centroid
    iterations: int


def squared_distances(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """(N, K) squared euclidean distances between rows of x (N, D) and centroids (K, D)."""
    x_sq = (x * x).sum(dim=1, keepdim=True)  # (N, 1)
    c_sq = (centroids * centroids).sum(dim=1)[None, :]  # (1, K)
    return (x_sq - 2.0 * x @ centroids.T + c_sq).clamp_min(0.0)  # (N, K)


def feature_chunks(x: torch.Tensor, num_levels: int) -> list[torch.Tensor]:
    """The L contiguous sub-vectors product k-means clusters, (N, D_l) each."""
    if x.shape[1] < num_levels:
        raise ValueError(f"{x.shape[1]} feature dims cannot be cut into {num_levels} levels")
    return list(torch.tensor_split(x, num_levels, dim=1))


def kmeans_plus_plus(x: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k-means++ seeding (Arthur & Vassilvitskii, 2007): each next centroid is a
    point drawn with probability proportional to its squared distance to the
    nearest centroid so far. Returns (k, D)."""
    n = x.shape[0]
    first = int(torch.randint(n, (1,), generator=generator).item())
    chosen = [first]
    nearest = squared_distances(x, x[first : first + 1]).squeeze(1)  # (N,)
    for _ in range(1, k):
        weights = nearest if float(nearest.sum()) > 0 else torch.ones_like(nearest)
        idx = int(torch.multinomial(weights, 1, generator=generator).item())
        chosen.append(idx)
        nearest = torch.minimum(nearest, squared_distances(x, x[idx : idx + 1]).squeeze(1))
    return x[chosen].clone()


def kmeans(
    x: torch.Tensor, k: int, *, seed: int = 0, max_iter: int = 100, tol: float = 1e-10
) -> KMeansResult:
    """Lloyd's algorithm from k-means++ seeds on x (N, D).

    An empty cluster is re-seeded with the point farthest from its centroid, so
    every centroid ends up owning at least one point when N >= k.
    """
    if x.ndim != 2:
        raise ValueError(f"features must be (N, D), got shape {tuple(x.shape)}")
    n = x.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"cannot make {k} clusters from {n} documents; use more documents")
    x = x.double()
    generator = torch.Generator().manual_seed(seed)
    centroids = kmeans_plus_plus(x, k, generator)  # (K, D)
    labels = torch.full((n,), -1, dtype=torch.long)
    iterations = 0
    while iterations < max_iter:
        iterations += 1
        dist = squared_distances(x, centroids)  # (N, K)
        new_labels = dist.argmin(dim=1)  # (N,)
        _reseed_empty(dist, new_labels, k)
        sums = torch.zeros_like(centroids).index_add_(0, new_labels, x)  # (K, D)
        sizes = torch.bincount(new_labels, minlength=k).double()  # (K,)
        new_centroids = sums / sizes[:, None]
        shift = float(((new_centroids - centroids) ** 2).sum())
        centroids = new_centroids
        converged = bool((new_labels == labels).all()) or shift <= tol
        labels = new_labels
        if converged:
            break
    dist = squared_distances(x, centroids)
    inertia = float(dist.gather(1, labels[:, None]).sum())
    return KMeansResult(centroids=centroids, labels=labels, inertia=inertia, iterations=iterations)


def _reseed_empty(dist: torch.Tensor, labels: torch.Tensor, k: int) -> None:
    """Give each empty cluster the point farthest from its own centroid (in place)."""
    sizes = torch.bincount(labels, minlength=k)
    empty = (sizes == 0).nonzero().flatten().tolist()
    if not empty:
        return
    own = dist.gather(1, labels[:, None]).squeeze(1).clone()  # (N,)
    for cluster in empty:
        # Never take the last point of a cluster, or we would empty another one.
        sizes = torch.bincount(labels, minlength=k)
        own[sizes[labels] <= 1] = -1.0
        idx = int(own.argmax())
        if own[idx] < 0:
            return  # fewer distinct points than clusters: nothing left to move
        labels[idx] = cluster
        own[idx] = -1.0


def product_kmeans(
    x: torch.Tensor, factors: Sequence[int], *, seed: int = 0, max_iter: int = 100
) -> list[KMeansResult]:
    """One k-means per level on that level's sub-vector; level l uses seed + l."""
    chunks = feature_chunks(x, len(factors))
    return [
        kmeans(chunk, k, seed=seed + level, max_iter=max_iter)
        for level, (chunk, k) in enumerate(zip(chunks, factors, strict=True))
    ]
