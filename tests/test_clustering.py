"""HFLDD's clustering: the KL matrix of soft labels, K-Means and ClusterSampling (Alg. 1)."""

from __future__ import annotations

import pytest
import torch

from hetfl.fl.clustering import cluster_sampling, homogeneous_clusters, kl_matrix


def test_the_kl_matrix_equals_a_slow_loop():
    torch.manual_seed(0)
    soft = torch.softmax(torch.randn(4, 7, 3), dim=2)
    m = kl_matrix(soft)
    for i in range(4):
        for j in range(4):
            p, q = soft[i].double().clamp(min=1e-8), soft[j].double().clamp(min=1e-8)
            assert float(m[i, j]) == pytest.approx(float((p * (p / q).log()).sum(1).mean()), rel=1e-9)
    assert torch.allclose(m.diagonal(), torch.zeros(4, dtype=torch.float64))


def test_soft_labels_of_one_class_clients_cluster_by_class():
    from sklearn.metrics import adjusted_rand_score

    torch.manual_seed(1)
    classes = [c for c in range(5) for _ in range(4)]  # C = 1: 20 clients, 4 per class
    logits = torch.randn(20, 30, 5) * 0.3
    for i, c in enumerate(classes):
        logits[i, :, c] += 4.0  # each client's model predicts its own class
    labels = homogeneous_clusters(kl_matrix(torch.softmax(logits, dim=2)), 5, seed=0)
    assert adjusted_rand_score(classes, labels) == 1.0


@pytest.mark.parametrize("seed", [0, 1])
def test_cluster_sampling_takes_one_client_per_homogeneous_cluster(seed):
    labels = [0] * 5 + [1] * 3 + [2] * 7 + [3]
    clusters, heads = cluster_sampling(labels, seed)
    assert len(clusters) == 7  # H = the largest homogeneous cluster
    assert sorted(c for cl in clusters for c in cl) == list(range(len(labels)))  # a partition
    for cluster, head in zip(clusters, heads):
        assert len({labels[c] for c in cluster}) == len(cluster) and head in cluster
    assert cluster_sampling(labels, seed) == (clusters, heads)  # the seed fixes it


def test_one_homogeneous_cluster_gives_singletons_and_bad_k_fails():
    clusters, heads = cluster_sampling(homogeneous_clusters(torch.zeros(6, 6), 1, 0), 0)
    assert sorted(map(tuple, clusters)) == [(i,) for i in range(6)] and sorted(heads) == list(range(6))
    with pytest.raises(ValueError, match="K = 7 must lie in"):
        homogeneous_clusters(torch.zeros(6, 6), 7, 0)
