"""Models of real size (ResNet-18/50, a GPT-2-style decoder) and their shape twins."""

import pytest
import torch
import torch.nn.functional as F
from train_helpers import output, run_train, summary

from hybridagg.train.architectures import (
    GPT2,
    ShapeTwin,
    gpt2,
    resnet18,
    resnet50,
    twin,
)
from hybridagg.train.models import build_model

REAL = {"resnet18": resnet18, "resnet50": resnet50, "gpt2": gpt2}
TWINS = [f"{name}-twin" for name in REAL]
DIGITS = (64,)
IMAGES = (3, 32, 32)


def _meta(factory, shape, classes):
    with torch.device("meta"):
        return factory(shape, classes)


def _shapes(model):
    return [tuple(p.shape) for p in model.parameters()]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from hybridagg.data import convert_digits

    path = tmp_path_factory.mktemp("data") / "digits.h5"
    convert_digits(path, val_fraction=0.2, seed=0, progress=False)
    return str(path)


# ------------------------------------------------------------ the real models
@pytest.mark.parametrize(
    "factory,params,tensors",
    [(resnet18, 11_689_512, 62), (resnet50, 25_557_032, 161)],
)
def test_resnets_have_torchvision_s_parameters(factory, params, tensors):
    model = _meta(factory, IMAGES, 1000)
    assert sum(p.numel() for p in model.parameters()) == params
    assert len(list(model.parameters())) == tensors
    named = dict(model.named_parameters())
    # torchvision's names, so its weights load by state dict
    assert named["conv1.weight"].shape == (64, 3, 7, 7)
    assert named["layer2.0.downsample.0.weight"].shape[2:] == (1, 1)
    assert named["fc.weight"].shape == (1000, 2048 if factory is resnet50 else 512)
    if factory is resnet50:
        # v1.5: the stride sits on the 3x3 convolution
        assert model.layer2[0].conv2.stride == (2, 2)
        assert model.layer2[0].conv1.stride == (1, 1)


def test_resnet_channels_and_classes_come_from_the_data():
    model = _meta(resnet50, DIGITS, 10)
    assert model.conv1.weight.shape == (64, 1, 7, 7)
    assert model.fc.weight.shape == (10, 2048)


@pytest.mark.parametrize("name", [*REAL, *TWINS])
@pytest.mark.parametrize("shape", [DIGITS, IMAGES])
def test_zoo_names_map_samples_to_logits(name, shape):
    model = build_model(name, shape, 7)
    with torch.no_grad():
        out = model(torch.randn(3, *shape))
    assert out.shape == (3, 7) and torch.isfinite(out).all()
    assert not torch.equal(out[0], out[1])  # each sample its own logits


def test_gpt2_reads_patches_and_attends_causally():
    model = GPT2(DIGITS, 10)
    assert (model.patch, model.tokens) == (4, 16)  # the digits: 16 tokens of 4
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["transformer.wte.weight", "transformer.wte.bias"]
    assert "transformer.h.3.attn.c_attn.weight" in names
    assert names[-4:] == [
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
        "head.weight",
        "head.bias",
    ]
    assert model.transformer.h[0].attn.c_attn.weight.shape == (3 * 256, 256)
    seen = []
    model.transformer.ln_f.register_forward_hook(lambda m, i, o: seen.append(o))
    x = torch.randn(2, 64)
    later = x.clone()
    later[:, -4:] += 1.0  # only the last token changes
    with torch.no_grad():
        a, b = model(x), model(later)
    assert torch.allclose(seen[0][:, :-1], seen[1][:, :-1], atol=1e-6)
    assert not torch.allclose(a, b)  # the head reads the last token


def test_gpt2_sizes_long_samples_to_at_most_max_tokens():
    model = GPT2(IMAGES, 10)
    assert model.tokens <= 64 and model.tokens * model.patch >= 3 * 32 * 32
    with pytest.raises(ValueError, match="n_embd 100 is not a multiple of n_head 3"):
        GPT2(DIGITS, 10, n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="patch must be >= 1"):
        GPT2(DIGITS, 10, patch=0)


# ------------------------------------------------------------------ the twins
@pytest.mark.parametrize("name", list(REAL))
@pytest.mark.parametrize("shape", [DIGITS, IMAGES])
def test_a_twin_has_the_reference_s_tensors_in_order(name, shape):
    reference = _meta(REAL[name], shape, 10)
    model = build_model(f"{name}-twin", shape, 10)
    assert isinstance(model, ShapeTwin)
    assert _shapes(model) == _shapes(reference)
    assert [p.dtype for p in model.parameters()] == [
        p.dtype for p in reference.parameters()
    ]
    assert model.reference_names == tuple(n for n, _ in reference.named_parameters())
    # the buffers an optimizer averages are the same size too
    assert [tuple(b.shape) for b in model.buffers()] == [
        tuple(b.shape) for b in reference.buffers()
    ]
    assert all(p.device.type == "cpu" for p in model.parameters())


def _grads(model, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", TWINS)
def test_twin_gradients_are_dense_and_depend_on_the_batch(name):
    torch.manual_seed(0)
    model = build_model(name, DIGITS, 10)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    first = _grads(model, x, y)
    again = _grads(model, x, y)
    other = _grads(model, torch.randn(8, 64), y)
    for n, g, g2, h in zip(model.reference_names, first, again, other, strict=True):
        assert (g != 0).float().mean() > 0.99, n
        assert torch.isfinite(g).all(), n
        assert torch.equal(g, g2), n  # a function of the batch alone
        assert not torch.allclose(g, h), n


@pytest.mark.parametrize("name", TWINS)
def test_twin_gradients_become_ready_in_reverse_order(name):
    model = build_model(name, DIGITS, 10)
    order = []
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda _, i=i: order.append(i))
    F.cross_entropy(model(torch.randn(4, 64)), torch.tensor([0, 1, 2, 3])).backward()
    assert order == list(reversed(range(len(list(model.parameters())))))


def test_a_twin_trains_its_logits():
    torch.manual_seed(0)
    model = build_model("resnet18-twin", DIGITS, 10)
    x, y = torch.randn(16, 64), torch.full((16,), 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def test_a_twin_of_any_module_and_its_errors():
    reference = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3))
    model = twin(reference, (5,), 2)
    assert [n for n, _ in model.named_parameters()] == [
        "0_weight",
        "0_bias",
        "1_weight",
        "1_bias",
    ]
    assert model(torch.randn(4, 5)).shape == (4, 2)
    with pytest.raises(ValueError, match="has no parameters"):
        twin(torch.nn.ReLU(), (5,), 2)
    with pytest.raises(ValueError, match="width must be >= 1"):
        twin(reference, (5,), 2, width=0)

    class Clash(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(2, 2)
            self.a_weight = torch.nn.Parameter(torch.zeros(1))

    with pytest.raises(ValueError, match="both become 'a_weight'"):
        twin(Clash(), (2,), 2)


# ---------------------------------------------------------------- end to end
def test_train_runs_the_resnet50_twin(digits, tmp_path):
    out = tmp_path / "s.json"
    args = ["--data", digits, "--model", "resnet50-twin", "--steps", "2"]
    result = run_train(1, [*args, "--no-progress", "--summary", str(out)])
    assert result.returncode == 0, output(result)[-3000:]
    s = summary(out)
    assert s["model"] == "resnet50-twin" and s["steps"] == 2
    assert s["samples"] == 2 * s["batch_size"]


def test_the_resnet50_twin_learns_the_digits_through_the_real_head(digits, tmp_path):
    """Its head is ResNet-50's fc on random features: times to target are real."""
    out = tmp_path / "s.json"
    args = [
        "--data",
        digits,
        "--model",
        "resnet50-twin",
        "--epochs",
        "4",
        "--lr",
        "0.05",
    ]
    result = run_train(
        2, [*args, "--mode", "sync", "--no-progress", "--summary", str(out)]
    )
    assert result.returncode == 0, output(result)[-3000:]
    assert summary(out)["final_accuracy"] >= 0.9  # chance is 0.1


def test_a_twin_without_a_classifier_head_keeps_fixed_logits():
    from hybridagg.train.architectures import _classifier

    ref = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    assert _classifier(ref, 3) == ("2_weight", "2_bias", 16)
    assert _classifier(ref, 4) is None
    no_bias = torch.nn.Sequential(torch.nn.Linear(8, 5, bias=False))
    assert _classifier(no_bias, 5) == ("0_weight", None, 8)


def test_gpt2_pipeline_layers_compute_its_forward_and_share_its_parameters():
    from hybridagg.pipeline import model_layers
    from hybridagg.train.architectures import GPT2

    torch.manual_seed(0)
    model = GPT2((64,), 10, n_layer=3)
    layers = model_layers(model)
    assert len(layers) == 5  # embedding, three blocks, head
    x = torch.randn(4, 64)
    h = x
    for layer in layers:
        h = layer(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)
    shared = {id(p) for layer in layers for p in layer.parameters()}
    assert shared == {id(p) for p in model.parameters()}
