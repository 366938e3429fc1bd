"""The generated ``synthetic`` dataset and load_dataset's name/option checks."""

from __future__ import annotations

import re

import pytest
import torch

from hetfl.data import DATASET_NAMES, DatasetSplits, load_dataset
from hetfl.data.synthetic import load_synthetic


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("size", [16, 28])
@pytest.mark.parametrize("classes", [4, 10])
def test_shapes_dtypes_and_balanced_classes(channels, size, classes):
    splits = load_synthetic(classes=classes, channels=channels, size=size, train_per_class=6, test_per_class=3)
    assert isinstance(splits, DatasetSplits)
    assert splits.num_classes == classes
    assert splits.shape == (channels, size, size)
    for split, per_class in ((splits.train, 6), (splits.test, 3)):
        assert tuple(split.x.shape) == (classes * per_class, channels, size, size)
        assert split.x.dtype == torch.uint8
        assert split.y.dtype == torch.int64
        assert split.num_classes == classes
        assert split.name == "synthetic"
        # Exactly per_class samples of every class.
        assert split.label_counts().tolist() == [per_class] * classes
        assert len(split) == classes * per_class


def test_default_sizes():
    splits = load_synthetic()
    assert tuple(splits.train.x.shape) == (2000, 1, 28, 28)
    assert tuple(splits.test.x.shape) == (500, 1, 28, 28)
    assert splits.train.label_counts().tolist() == [200] * 10
    assert splits.test.label_counts().tolist() == [50] * 10
    # The default difficulty is still far above chance (0.1) for a nearest-class-mean rule.
    assert _nearest_mean_accuracy(splits) > 0.5


def test_labels_are_shuffled_not_sorted():
    y = load_synthetic(classes=4, train_per_class=20, test_per_class=5).train.y
    assert not torch.equal(y, torch.sort(y).values)


def test_images_use_the_pixel_range():
    x = load_synthetic(classes=4, train_per_class=20, test_per_class=5).train.x
    assert int(x.min()) == 0 and int(x.max()) == 255  # noise saturates at both ends
    assert x.float().std() > 20


def test_same_seed_identical_different_seed_different():
    kwargs = {"classes": 4, "channels": 3, "size": 16, "train_per_class": 8, "test_per_class": 4}
    a = load_synthetic(seed=7, **kwargs)
    b = load_synthetic(seed=7, **kwargs)
    c = load_synthetic(seed=8, **kwargs)
    for split in ("train", "test"):
        assert torch.equal(getattr(a, split).x, getattr(b, split).x)
        assert torch.equal(getattr(a, split).y, getattr(b, split).y)
        assert not torch.equal(getattr(a, split).x, getattr(c, split).x)
    assert not torch.equal(a.train.y, c.train.y)


def test_train_and_test_are_different_samples():
    s = load_synthetic(classes=4, train_per_class=5, test_per_class=5)
    assert not torch.equal(s.train.x, s.test.x)


def _nearest_mean_accuracy(splits: DatasetSplits) -> float:
    train_x = splits.train.x.flatten(1).float()
    test_x = splits.test.x.flatten(1).float()
    means = torch.stack([train_x[splits.train.y == k].mean(0) for k in range(splits.num_classes)])
    pred = torch.cdist(test_x, means).argmin(1)
    return (pred == splits.test.y).float().mean().item()


def test_classes_are_learnable_and_noise_makes_it_harder():
    easy = load_synthetic(classes=10, size=16, train_per_class=30, test_per_class=20, noise=0.05, max_shift=0)
    hard = load_synthetic(classes=10, size=16, train_per_class=30, test_per_class=20, noise=2.0, max_shift=2)
    easy_acc = _nearest_mean_accuracy(easy)
    hard_acc = _nearest_mean_accuracy(hard)
    assert easy_acc > 0.9  # chance is 0.1
    assert hard_acc < easy_acc


def test_zero_noise_no_shift_samples_are_scaled_prototypes():
    # Without noise or shifts every sample of a class is brightness x the same prototype, so the
    # per-pixel ordering (argmax pixel) is shared by all samples of a class.
    s = load_synthetic(classes=3, size=16, train_per_class=10, test_per_class=2, noise=0.0, max_shift=0)
    flat = s.train.x.flatten(1)
    for k in range(3):
        rows = flat[s.train.y == k].float()
        normalised = rows / rows.amax(dim=1, keepdim=True)
        assert (normalised - normalised[0]).abs().max() < 0.05


@pytest.mark.parametrize(
    "kwargs",
    [
        {"classes": 1},
        {"classes": 0},
        {"channels": 0},
        {"size": 7},
        {"size": 0},
        {"train_per_class": 0},
        {"test_per_class": 0},
        {"train_per_class": -3},
    ],
)
def test_bad_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError, match="synthetic needs"):
        load_synthetic(**kwargs)


# --------------------------------------------------------------------------- load_dataset


def test_load_dataset_synthetic_passes_options():
    options = {"classes": 5, "channels": 3, "size": 12, "train_per_class": 4, "test_per_class": 2, "seed": 3}
    splits = load_dataset("synthetic", options=options)
    assert splits.num_classes == 5
    assert splits.shape == (3, 12, 12)
    assert splits.train.label_counts().tolist() == [4] * 5
    assert splits.test.label_counts().tolist() == [2] * 5
    direct = load_synthetic(**options)
    assert torch.equal(splits.train.x, direct.train.x)
    assert torch.equal(splits.test.y, direct.test.y)


def test_load_dataset_synthetic_ignores_root():
    a = load_dataset("synthetic", root="/nonexistent/dir", options={"classes": 2, "train_per_class": 2})
    assert len(a.train) == 4


def test_load_dataset_does_not_mutate_options():
    options = {"classes": 3, "train_per_class": 2, "test_per_class": 1}
    load_dataset("synthetic", options=options)
    assert options == {"classes": 3, "train_per_class": 2, "test_per_class": 1}


def test_load_dataset_unknown_option_lists_valid_options():
    with pytest.raises(ValueError, match=re.escape("dataset 'synthetic' does not take ['colour']")) as info:
        load_dataset("synthetic", options={"colour": True, "classes": 3})
    message = str(info.value)
    assert "valid options" in message
    for name in ("classes", "channels", "size", "train_per_class", "test_per_class", "noise", "max_shift", "seed"):
        assert name in message


def test_load_dataset_bad_option_value_raises():
    with pytest.raises(ValueError, match="synthetic needs"):
        load_dataset("synthetic", options={"size": 4})


def test_load_dataset_unknown_option_for_file_dataset_says_none(tmp_path):
    with pytest.raises(ValueError, match="valid options: none"):
        load_dataset("mnist", root=tmp_path, options={"split": "x"})


@pytest.mark.parametrize("name", ["nope", "MNIST", ""])
def test_load_dataset_unknown_name_lists_dataset_names(name):
    with pytest.raises(ValueError, match=re.escape(f"unknown dataset {name!r}")) as info:
        load_dataset(name)
    message = str(info.value)
    assert ", ".join(DATASET_NAMES) in message
    for known in ("mnist", "fmnist", "cifar10", "synthetic"):
        assert known in message
