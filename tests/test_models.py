"""Tests for the model zoo (hetfl.models): shapes, extract/classify split, determinism,
parameter counts, channels_last, errors and FLOP counting."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hetfl.models import (
    MODEL_NAMES,
    HetflModel,
    ModelSpec,
    build_model,
    count_flops,
    count_parameters,
    get_model_class,
)

NUM_CLASSES = 10
INPUTS = [(1, 28), (3, 28), (1, 32), (3, 32), (1, 64), (3, 64)]  # (channels, image size)


def images(channels: int, size: int, n: int = 2, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, channels, size, size, generator=gen)


def build(name: str, channels: int = 3, size: int = 32, seed: int = 0) -> HetflModel:
    torch.manual_seed(seed)
    return build_model(name, channels, size, NUM_CLASSES)


def test_the_unpadded_lenet5_is_hfldds_mnist_cnn() -> None:
    model = build_model("lenet5_valid", 1, 28, 10)
    assert sum(p.numel() for p in model.parameters()) == 44_426


def test_registry_names() -> None:
    assert list(MODEL_NAMES) == sorted(MODEL_NAMES)
    assert set(MODEL_NAMES) == {
        "cnn2",
        "cnn3",
        "googlenet",
        "lenet5",
        "lenet5_valid",
        "mobilenetv2",
        "resnet18",
        "shufflenetv2",
        "simplecnn",
        "vgg9",
    }


@pytest.mark.parametrize(("channels", "size"), INPUTS)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_every_input(name: str, channels: int, size: int) -> None:
    model = build(name, channels, size)
    assert isinstance(model, HetflModel)
    assert (model.arch, model.in_channels, model.image_size, model.num_classes) == (
        name,
        channels,
        size,
        NUM_CLASSES,
    )
    n = 1 if name == "vgg9" and size == 64 else 2
    x = images(channels, size, n)
    out = model(x)  # train mode
    assert out.shape == (n, NUM_CLASSES)
    assert torch.isfinite(out).all()
    model.eval()
    with torch.no_grad():
        h = model.extract(x)
    assert tuple(h.shape[1:]) == model.feature_shape


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_is_classify_of_extract(name: str) -> None:
    model = build(name).eval()
    x = images(3, 32)
    with torch.no_grad():
        out = model(x)
        split = model.classify(model.extract(x))
    assert torch.allclose(out, split, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_backward_reaches_every_parameter(name: str) -> None:
    model = build(name)
    model(images(3, 32)).sum().backward()
    missing = [k for k, p in model.named_parameters() if p.grad is None]
    assert not missing


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_same_seed_same_weights(name: str) -> None:
    a = build(name, 1, 28, seed=1).state_dict()
    b = build(name, 1, 28, seed=1).state_dict()
    c = build(name, 1, 28, seed=2).state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_construction_has_no_side_effects(name: str) -> None:
    """The dummy forward at construction must not touch BN statistics or the mode."""
    model = build(name, 1, 28)
    assert model.training
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert m.num_batches_tracked.item() == 0
            assert torch.equal(m.running_mean, torch.zeros_like(m.running_mean))
            assert torch.equal(m.running_var, torch.ones_like(m.running_var))


def test_parameter_counts() -> None:
    cnn2 = build("cnn2", 1, 28)
    # convs 416 + 12,832, BN 32 + 64, Linear 32*7*7*10 + 10 = 15,690
    assert count_parameters(cnn2) == 29_034
    assert abs(count_parameters(cnn2) - 29_000) <= 0.10 * 29_000

    cnn3 = build("cnn3", 3, 32)
    # convs 3,584 + 147,584 + 147,584, Linear 128*4*4*10 + 10 = 20,490
    assert count_parameters(cnn3) == 319_242
    assert abs(count_parameters(cnn3) - 319_000) <= 0.10 * 319_000

    vgg9 = build("vgg9", 1, 28)
    # conv 1->64: 9*64 + 64 = 640;  64->128: 9*64*128 + 128 = 73,856
    # 128->256: 9*128*256 + 256 = 295,168;  256->256: 9*256*256 + 256 = 590,080
    # FC 12544->4096: 51,380,224 + 4,096 = 51,384,320;  4096->4096: 16,777,216 + 4,096
    # = 16,781,312;  4096->10: 40,960 + 10 = 40,970.   Sum: 69,166,346.
    assert count_parameters(vgg9) == 69_166_346
    assert abs(count_parameters(vgg9) - 69_000_000) <= 0.05 * 69_000_000

    assert count_parameters(cnn2) == sum(p.numel() for p in cnn2.parameters())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_channels_last_matches_contiguous(name: str) -> None:
    model = build(name).eval()
    x = images(3, 32)
    with torch.no_grad():
        ref = model(x)
        out_input_only = model(x.to(memory_format=torch.channels_last))
        model_cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
        out = model_cl(x.to(memory_format=torch.channels_last))
        h = model_cl.extract(x.to(memory_format=torch.channels_last))
    assert torch.allclose(out_input_only, ref, rtol=1e-4, atol=1e-5)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)
    assert tuple(h.shape[1:]) == model.feature_shape


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown model 'foo'; choose one of: cnn2, cnn3, ") as e:
        build_model("foo", 3, 32, 10)
    assert all(name in str(e.value) for name in MODEL_NAMES)


def test_too_small_image() -> None:
    with pytest.raises(ValueError, match=r"model 'cnn3' cannot take image_size=16"):
        build_model("cnn3", 3, 16, 10)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_smallest_image(name: str) -> None:
    smallest = get_model_class(name).min_image_size
    model = build(name, 3, smallest)
    assert model(images(3, smallest)).shape == (2, NUM_CLASSES)
    with pytest.raises(ValueError, match=f"'{name}'.*image_size={smallest - 1}"):
        build_model(name, 3, smallest - 1, NUM_CLASSES)


@pytest.mark.parametrize(("channels", "size"), INPUTS)
def test_simplecnn_feature_map(channels: int, size: int) -> None:
    model = build("simplecnn", channels, size).eval()
    assert model.feature_shape == (16, 5, 5)
    with torch.no_grad():
        assert model.extract(images(channels, size)).shape == (2, 16, 5, 5)
        h = torch.rand(3, 16, 5, 5)  # e.g. KDIA's generated feature maps
        assert model.classify(h).shape == (3, NUM_CLASSES)
        z = model.projection(h)
        assert z.shape == (3, 256)
        assert torch.allclose(model.classify(h), model.head(z))


@pytest.mark.parametrize(("channels", "size"), INPUTS)
def test_simplecnn_skipped_pool_is_bit_identical(channels: int, size: int) -> None:
    """The 5x5 fit is skipped where the map is already 5x5 (28, 32 px): the same values and gradients
    as nn.AdaptiveAvgPool2d, bit for bit; at 64 px it still pools."""
    torch.manual_seed(0)
    model = build("simplecnn", channels, size)
    reference = copy.deepcopy(model)
    reference.extractor[6] = nn.AdaptiveAvgPool2d((5, 5))
    x = images(channels, size, n=4)
    outs = []
    for m in (model, reference):
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        out.sum().backward()
        outs.append((out, xi.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert isinstance(model.extractor[6], nn.AdaptiveAvgPool2d)


def test_model_spec_round_trip() -> None:
    spec = ModelSpec("lenet5", 1, 28, NUM_CLASSES)
    torch.manual_seed(3)
    model = spec.build()
    assert model.spec == spec
    assert model.feature_shape == (84,)
    with pytest.raises(ValueError, match="unknown model"):
        ModelSpec("nope", 1, 28, NUM_CLASSES).build()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_count_flops_positive(name: str) -> None:
    model = build(name)
    flops = count_flops(model, 3, 32)
    assert isinstance(flops, int)
    assert flops > 0
    assert model.training  # mode restored


def test_count_flops_orders_models() -> None:
    cnn2 = count_flops(build("cnn2"), 3, 32)
    resnet18 = count_flops(build("resnet18"), 3, 32)
    assert cnn2 < resnet18
    # 2 FLOPs per MAC: the final Linear of cnn2 alone is 2 * 2048 * 10
    assert cnn2 >= 2 * 2048 * NUM_CLASSES


def test_generator_reset_draws_the_same_weights_in_either_layout():
    """normal_ fills memory in order; reset_parameters must not let the layout change the draws,
    and the contiguous draws are DENSE's N(0, 0.02) / N(1, 0.02) in nn.init's order."""
    from hetfl.models.generator import Generator

    gens = [Generator(nz=8, ngf=4, image_size=8, channels=1) for _ in range(2)]
    gens[1].to(memory_format=torch.channels_last)
    assert not gens[1].conv_blocks[2].weight.is_contiguous()  # the layout really differs
    for g in gens:
        torch.manual_seed(3)
        g.reset_parameters()
    for (name, a), b in zip(gens[0].state_dict().items(), gens[1].state_dict().values()):
        assert torch.equal(a, b), name
    torch.manual_seed(3)
    expected = torch.empty(gens[0].l1.weight.shape).normal_(0.0, 0.02)  # the first module drawn
    assert torch.equal(gens[0].l1.weight, expected)
    assert int(torch.count_nonzero(gens[0].conv_blocks[0].bias.detach())) == 0


def assert_same_gradients(new: torch.Tensor, ref: torch.Tensor, inputs: tuple[torch.Tensor, ...],
                          atol: float = 1e-11) -> None:
    """The gradients of ``new`` and ``ref`` with respect to ``inputs`` agree for one random output gradient."""
    grad_out = torch.randn_like(ref)
    for g_new, g_ref in zip(torch.autograd.grad(new, inputs, grad_out), torch.autograd.grad(ref, inputs, grad_out)):
        torch.testing.assert_close(g_new, g_ref, rtol=0, atol=atol)


@pytest.mark.parametrize("bias", [False, True])
def test_upsample_conv3x3_equals_nearest_upsampling_then_the_conv_values_and_gradients(bias):
    """The low-resolution form of Up x2 -> Conv3x3 against the two layers one by one (float64)."""
    import torch.nn.functional as F

    from hetfl.models.generator import upsample_conv3x3

    torch.manual_seed(0)
    x = torch.randn(3, 5, 7, 6, dtype=torch.float64, requires_grad=True)  # odd, non-square: offsets, borders
    w = torch.randn(4, 5, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True) if bias else None
    ref = F.conv2d(F.interpolate(x, scale_factor=2, mode="nearest"), w, b, padding=1)
    new = upsample_conv3x3(x, w, b)
    assert new.shape == ref.shape == (3, 4, 14, 12)
    torch.testing.assert_close(new, ref, rtol=0, atol=1e-12)
    assert_same_gradients(new, ref, (x, w) + ((b,) if bias else ()))
    with pytest.raises(ValueError, match="3x3 kernel"):
        upsample_conv3x3(x, torch.randn(4, 5, 5, 5, dtype=torch.float64))
    xc = x.detach().to(memory_format=torch.channels_last).requires_grad_(True)  # the layout is kept
    out = upsample_conv3x3(xc, w.detach().to(memory_format=torch.channels_last), None)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, F.conv2d(F.interpolate(x.detach(), scale_factor=2, mode="nearest"),
                                             w.detach(), None, padding=1), rtol=0, atol=1e-12)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    xr = x.detach().requires_grad_(True)
    F.conv2d(F.interpolate(xr, scale_factor=2, mode="nearest"), w.detach(), None, padding=1).backward(grad_out)
    torch.testing.assert_close(xc.grad, xr.grad, rtol=0, atol=1e-11)  # the same gradient in either layout


@pytest.mark.parametrize(("bias", "size"), [(True, 1), (True, 3), (False, 4)])
def test_conv_transpose2x2_equals_the_library_transposed_conv_values_and_gradients(bias, size):
    """One GEMM and four shifted adds against F.conv_transpose2d (2x2, stride 1; float64), on a 1 x 1
    map (the feature generator's first layer) and larger ones."""
    import torch.nn.functional as F

    from hetfl.models.generator import conv_transpose2x2

    torch.manual_seed(0)
    x = torch.randn(3, 5, size, size + 1, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, 2, 2, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True) if bias else None
    ref, new = F.conv_transpose2d(x, w, b), conv_transpose2x2(x, w, b)
    assert new.shape == ref.shape == (3, 4, size + 1, size + 2)
    torch.testing.assert_close(new, ref, rtol=0, atol=1e-12)
    assert_same_gradients(new, ref, (x, w) + ((b,) if bias else ()))
    with pytest.raises(ValueError, match="2x2 kernel"):
        conv_transpose2x2(x, torch.randn(5, 4, 3, 3, dtype=torch.float64))


@pytest.mark.parametrize("train", [True, False])
def test_feature_generator_equals_its_layers_run_one_by_one(train):
    """KDIA's generator (GEMM transposed convolutions) against its nn.Sequential run as is: outputs,
    BN running statistics and parameter gradients (float64)."""
    from hetfl.models.generator import FeatureGenerator

    torch.manual_seed(2)
    gen = FeatureGenerator(12, 10, (16, 5, 5)).double().train(train)
    plain = copy.deepcopy(gen)
    noise, labels = torch.randn(6, 12, dtype=torch.float64), torch.randint(0, 10, (6,))
    out = gen(noise, labels)
    ref = plain.net(torch.cat([noise, plain.embed(labels)], dim=1)[:, :, None, None])
    assert out.shape == (6, 16, 5, 5) and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for (name, a), b in zip(gen.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(gen.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("channels_last", [False, True])
def test_fused_generator_is_the_layer_by_layer_generator_in_train_and_eval(channels_last):
    """Same parameters, same outputs, same BN running statistics, same parameter gradients."""
    from hetfl.models.generator import Generator

    torch.manual_seed(1)
    fused = Generator(nz=16, ngf=8, image_size=28, channels=1).double()
    plain = Generator(nz=16, ngf=8, image_size=28, channels=1, fused_upsample=False).double()
    plain.load_state_dict(fused.state_dict())
    if channels_last:
        fused.to(memory_format=torch.channels_last)
        plain.to(memory_format=torch.channels_last)
    z = torch.randn(6, 16, dtype=torch.float64)
    out_f, out_p = fused(z), plain(z)  # train mode: batch statistics
    assert out_f.shape == (6, 1, 28, 28)
    torch.testing.assert_close(out_f, out_p, rtol=0, atol=1e-12)
    out_f.square().sum().backward()
    out_p.square().sum().backward()
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-10, msg=name)
    for (name, a), b in zip(fused.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)  # running statistics too
    fused.eval()
    plain.eval()
    torch.testing.assert_close(fused(z), plain(z), rtol=0, atol=1e-12)
