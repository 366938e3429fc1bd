"""HFLDD's client clustering (Sec. IV-A, Alg. 1): homogeneous clusters from the clients' soft labels on a
shared auxiliary set, then heterogeneous clusters that take one client of each homogeneous cluster.

* :func:`kl_matrix`: M_ij = KL(S_i || S_j) averaged over the auxiliary images (Eq. 4), probabilities
  clamped at 1e-8, for all pairs at once.
* :func:`homogeneous_clusters`: seeded K-Means (scikit-learn) on the rows of M.
* :func:`cluster_sampling`: Alg. 1: repeatedly draw one random client from each non-empty homogeneous
  cluster into a new heterogeneous cluster, until all are placed; so H = the largest homogeneous
  cluster's size; each heterogeneous cluster gets one random head.

And FedSeq's superclients (Zaccone et al., 2022): :func:`greedy_superclients`.
"""

from __future__ import annotations

import numpy as np
import torch


def kl_matrix(soft: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(N, N) mean KL(S_i || S_j) over the auxiliary set, from (N, |D_g|, C) probabilities."""
    p = soft.double().clamp(min=eps)
    logp = p.log()
    g = p.shape[1]
    self_term = (p * logp).sum(dim=(1, 2)) / g  # mean_g sum_c S_i log S_i
    cross = torch.einsum("igc,jgc->ij", p, logp) / g  # mean_g sum_c S_i log S_j
    return self_term[:, None] - cross


def homogeneous_clusters(m: torch.Tensor, k: int, seed: int) -> list[int]:
    """A K-Means cluster label per client (rows of M as features), seeded."""
    from sklearn.cluster import KMeans

    if not 1 <= k <= len(m):
        raise ValueError(f"clusters: K = {k} must lie in [1, {len(m)}] (the number of clients)")
    if k == 1:
        return [0] * len(m)
    return KMeans(n_clusters=k, random_state=seed, n_init=10).fit(m.numpy()).labels_.tolist()


def cluster_sampling(labels: list[int], seed: int) -> tuple[list[list[int]], list[int]]:
    """Alg. 1: heterogeneous clusters (each a list of client ids) and their heads."""
    rng = np.random.default_rng(seed)
    pools = {c: list(rng.permutation([i for i, lab in enumerate(labels) if lab == c])) for c in sorted(set(labels))}
    clusters: list[list[int]] = []
    while any(pools.values()):
        clusters.append(sorted(int(pool.pop()) for pool in pools.values() if pool))
    heads = [int(rng.choice(members)) for members in clusters]
    return clusters, heads


def greedy_superclients(histograms: torch.Tensor, min_samples: int, max_clients: int, seed: int,
                        eps: float = 1e-8) -> list[list[int]]:
    """FedSeq's greedy superclients from (N, C) class histograms: the clients in a seeded order; a
    superclient starts with the first client left and then takes, while it holds fewer than
    ``min_samples`` samples and fewer than ``max_clients`` clients, the client left whose class
    distribution p maximises KL(q || p), q the superclient's pooled class distribution (ties: the
    earliest in the order). The last superclient keeps whatever is left."""
    counts = histograms.double()
    order = torch.randperm(len(counts), generator=torch.Generator().manual_seed(seed)).tolist()
    dist = (counts / counts.sum(1, keepdim=True).clamp(min=1)).clamp(min=eps)
    groups: list[list[int]] = []
    while order:
        group = [order.pop(0)]
        pooled = counts[group[0]].clone()
        while order and pooled.sum() < min_samples and len(group) < max_clients:
            q = (pooled / pooled.sum().clamp(min=1)).clamp(min=eps)
            kl = (q * (q.log() - dist[order].log())).sum(1)  # KL(q || p) for every client left
            best = order.pop(int(torch.argmax(kl)))  # argmax: the first of equals
            group.append(best)
            pooled += counts[best]
        groups.append(group)
    return groups
