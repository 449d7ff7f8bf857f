"""Models of real size for the zoo, and their shape twins for emulation.

The zoo's small models (a 38 KB MLP) make communication free; these make it
cost what it costs in practice:

* :func:`resnet18`, :func:`resnet50`: torchvision's ResNet v1.5, layer for
  layer and parameter for parameter (same names, order and initialisation),
  written here so that hybridagg does not depend on torchvision (whose wheel
  pins a torch of its own).
* :func:`gpt2`: a small GPT-2-style decoder (pre-LN blocks, fused ``c_attn``,
  causal attention, GELU MLP) that reads a sample as a sequence of patches
  and classifies it from its last token.
* :class:`ShapeTwin` (:func:`twin`): a model with the same parameter tensors
  as a reference, size for size and in the same order, whose forward and
  backward are cheap but whose gradients are dense, depend on the input and
  become ready in backward order (the last parameter's first). A twin is for
  timing and communication only: it learns little (only a shift of the
  logits), so its accuracy means nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .models import image_shape

__all__ = [
    "GPT2",
    "ResNet",
    "ShapeTwin",
    "gpt2",
    "gpt2_twin",
    "resnet18",
    "resnet18_twin",
    "resnet50",
    "resnet50_twin",
    "twin",
]


# ----------------------------------------------------------------- ResNet
def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride, bias=False)


class BasicBlock(nn.Module):
    """ResNet-18/34's block: two 3x3 convolutions, each followed by BatchNorm."""

    expansion = 1

    def __init__(
        self, cin: int, planes: int, stride: int, downsample: nn.Module | None
    ) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """ResNet-50's block: 1x1, 3x3 (with the stride: v1.5), 1x1 to 4x the width."""

    expansion = 4

    def __init__(
        self, cin: int, planes: int, stride: int, downsample: nn.Module | None
    ) -> None:
        super().__init__()
        self.conv1 = _conv1x1(cin, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's ``ResNet`` for samples of shape ``sample_shape``.

    Flat samples (the digits' ``(64,)``) are viewed as a square one-channel
    image (:func:`~hybridagg.train.models.image_shape`). The stem is
    torchvision's (7x7/2 convolution, 3x3/2 max pool) whatever the image
    size; the adaptive average pool makes an 8x8 image work (its last two
    stages run at 1x1, where BatchNorm in training needs batches of 2 or
    more, as in torchvision).
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: Sequence[int],
        sample_shape: tuple[int, ...],
        num_classes: int,
    ) -> None:
        super().__init__()
        self.in_shape = image_shape(sample_shape)
        self._inplanes = 64
        self.conv1 = nn.Conv2d(self.in_shape[0], 64, 7, 2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0], 1)
        self.layer2 = self._make_layer(block, 128, layers[1], 2)
        self.layer3 = self._make_layer(block, 256, layers[2], 2)
        self.layer4 = self._make_layer(block, 512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        # torchvision's initialisation (the Linear keeps torch's default)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        planes: int,
        blocks: int,
        stride: int,
    ) -> nn.Sequential:
        out = planes * block.expansion
        downsample = None
        if stride != 1 or self._inplanes != out:
            downsample = nn.Sequential(
                _conv1x1(self._inplanes, out, stride), nn.BatchNorm2d(out)
            )
        layers = [block(self._inplanes, planes, stride, downsample)]
        self._inplanes = out
        layers += [block(out, planes, 1, None) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(len(x), *self.in_shape)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(sample_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """ResNet-18 (torchvision's; 11,689,512 parameters at 3 channels, 1000 classes)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], sample_shape, num_classes)


def resnet50(sample_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """ResNet-50 v1.5 (torchvision's; 25,557,032 parameters at 3 channels, 1000 classes)."""
    return ResNet(Bottleneck, [3, 4, 6, 3], sample_shape, num_classes)


# ----------------------------------------------------------------- GPT-2
class _CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)  # q, k and v in one matmul
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            part.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for part in self.c_attn(x).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class _MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's gelu_new
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


def _gpt2_init(module: nn.Module, n_layer: int) -> None:
    """GPT-2's initialisation of ``module``'s parameters, by name: normal with
    std 0.02, residual projections scaled by ``1/sqrt(2 n_layer)``, biases
    zero, layer norms' weights one."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif "ln_" in name:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=0.02)


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_layer: int = 1) -> None:
        super().__init__()
        self.n_layer = n_layer  # (for the residual projections' scale)
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = _CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = _MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def init_weights(self) -> None:
        """GPT-2's initialisation of this block (a pipeline stage's own)."""
        _gpt2_init(self, self.n_layer)


class GPT2(nn.Module):
    """A GPT-2-style decoder that classifies a sample read as a sequence.

    The flattened sample (zero-padded to a whole number of patches) is cut
    into ``tokens`` patches of ``patch`` values; a linear embedding (``wte``,
    in place of GPT-2's token table) plus a learned position embedding
    (``wpe``) feed ``n_layer`` pre-LN blocks and a final ``ln_f``; a linear
    ``head`` reads the last token, which causal attention lets see them all.
    Initialisation follows GPT-2 (normal, std 0.02; residual projections
    scaled by ``1/sqrt(2 n_layer)``).
    """

    def __init__(
        self,
        sample_shape: tuple[int, ...],
        num_classes: int,
        *,
        patch: int | None = None,
        max_tokens: int = 64,
        n_embd: int = 256,
        n_head: int = 4,
        n_layer: int = 4,
    ) -> None:
        super().__init__()
        values = math.prod(sample_shape)
        for name, v in (
            ("max_tokens", max_tokens),
            ("n_embd", n_embd),
            ("n_head", n_head),
            ("n_layer", n_layer),
        ):
            if v < 1:
                raise ValueError(f"gpt2: {name} must be >= 1, got {v}")
        if patch is None:
            # 4 values a token (the digits' 64 values: 16 tokens), more for
            # larger samples so that attention stays within max_tokens
            patch = max(4, math.ceil(values / max_tokens))
        if patch < 1:
            raise ValueError(f"gpt2: patch must be >= 1, got {patch}")
        if n_embd % n_head:
            raise ValueError(
                f"gpt2: n_embd {n_embd} is not a multiple of n_head {n_head}"
            )
        self.patch = patch
        self.tokens = math.ceil(values / patch)
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Linear(patch, n_embd),
                "wpe": nn.Embedding(self.tokens, n_embd),
                "h": nn.ModuleList(
                    _Block(n_embd, n_head, n_layer) for _ in range(n_layer)
                ),
                "ln_f": nn.LayerNorm(n_embd),
            }
        )
        self.head = nn.Linear(n_embd, num_classes)
        self.n_layer = n_layer
        _gpt2_init(self, n_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _embed(self, x)
        for block in self.transformer.h:
            h = block(h)
        return self.head(self.transformer.ln_f(h)[:, -1])

    def pipeline_layers(self) -> list[nn.Module]:
        """The decoder as layers a pipelined group cuts into stages: the
        embedding, each block, and the head (final norm and classifier);
        they share this model's parameters."""
        return [_Embedding(self), *self.transformer.h, _Head(self)]


def _embed(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # (a GPT2 or its _Embedding: both carry patch, tokens, wte and wpe)
    flat = x.reshape(len(x), -1)
    flat = F.pad(flat, (0, model.tokens * model.patch - flat.shape[1]))
    seq = flat.view(len(x), model.tokens, model.patch)
    pos = torch.arange(model.tokens, device=x.device)
    return model.transformer.wte(seq) + model.transformer.wpe(pos)


class _Embedding(nn.Module):
    """:class:`GPT2`'s first pipeline layer (its ``wte`` and ``wpe``)."""

    def __init__(self, model: GPT2) -> None:
        super().__init__()
        self.patch, self.tokens = model.patch, model.tokens
        self.transformer = nn.ModuleDict(
            {"wte": model.transformer.wte, "wpe": model.transformer.wpe}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _embed(self, x)

    def init_weights(self) -> None:
        """GPT-2's initialisation of the embeddings."""
        _gpt2_init(self, 1)


class _Head(nn.Module):
    """:class:`GPT2`'s last pipeline layer (``ln_f`` and ``head`` on the last token)."""

    def __init__(self, model: GPT2) -> None:
        super().__init__()
        self.ln_f, self.head = model.transformer.ln_f, model.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(h)[:, -1])

    def init_weights(self) -> None:
        """GPT-2's initialisation of the final norm and the classifier."""
        _gpt2_init(self, 1)


def gpt2(sample_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A small GPT-2-style decoder classifier (256 wide, 4 heads, 4 layers)."""
    return GPT2(sample_shape, num_classes)


# ----------------------------------------------------------------- twins
def _flat_name(name: str) -> str:
    # register_parameter refuses dots; the twin keeps the reference's names
    # readable (``layer1_0_conv1_weight``)
    return name.replace(".", "_")


def _fan_in(p: torch.Tensor) -> int:
    """Columns of the twin's matrix view of ``p``: all but the first dimension.

    A weight ``(out, in, ...)`` becomes ``(out, in x ...)``, as a layer
    reads it: a short, wide matrix times a vector is one efficient pass
    over memory (a tall one with 1 or 3 columns, as a view by the last
    dimension gives a convolution, made the ResNet-50 twin's step 2 to 3
    times slower on a CPU). A vector is one row.
    """
    return p.numel() // p.shape[0] if p.dim() >= 2 and p.shape[0] else p.numel()


class ShapeTwin(nn.Module):
    """The reference's parameter tensors with cheap, input-dependent compute.

    Parameters: one per reference parameter, same shape, dtype and order
    (``parameters()`` of both zip shape for shape), named as the reference's
    with dots made underscores, freshly initialised (uniform in
    ``+-1/sqrt(fan-in)``). Buffers: the reference's, same shapes and
    dtypes, so that what an optimizer averages or a checkpoint holds is the
    same size too; the twin does not use them.

    Forward: a fixed random projection (seeded, the same on every rank, not a
    buffer so nothing extra is communicated) maps each flattened sample to
    ``z`` of ``width`` values; their batch mean is a hidden state ``h`` that
    passes through every parameter in registration order: for ``P`` viewed
    as ``(rows, k)`` (``rows`` its first dimension, 1 for a vector),
    ``y = P @ v`` with ``v`` the ``k`` first values of ``h`` repeated, and
    ``h += c * tanh(pool(y))`` (``pool`` folds ``y`` onto ``h``'s size).
    The gradient of ``P`` is the outer product of ``v`` with ``y``'s
    gradient: dense, input dependent, at O(numel) cost per step whatever
    the batch. Since each
    parameter's term needs the hidden state that all later ones read,
    autograd finishes the last parameter first, as in the real model's
    backward. Logits: ``(z + h) @ W`` for a fixed ``W``, plus, when the
    reference ends in a classifier (a last weight of ``(num_classes, k)``,
    with or without a bias), that classifier applied to ``k`` fixed random
    ReLU features of each sample. So the twin learns the task as a
    random-feature linear model does (the digits to above 0.9), with its
    head's gradients ready first, as the real head's are, and a time to
    target can be measured on it; its compute stays the twin's.

    Args:
        reference: The model to mirror (may live on the ``meta`` device).
        sample_shape: Shape of one sample.
        num_classes: Number of logits per sample.
        width: Size of the hidden state.
        seed: Seed of the fixed projections.

    Raises:
        ValueError: Two reference names coincide once their dots are
            replaced, a non-positive ``width``, or no parameters.
    """

    def __init__(
        self,
        reference: nn.Module,
        sample_shape: tuple[int, ...],
        num_classes: int,
        *,
        width: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"twin: width must be >= 1, got {width}")
        if num_classes < 1:
            raise ValueError(f"twin: num_classes must be >= 1, got {num_classes}")
        self.width = width
        self.sample_shape = tuple(sample_shape)
        self.num_classes = num_classes
        self.seed = seed
        self.reference_names: tuple[str, ...] = ()
        seen: dict[str, str] = {}

        def flat(name: str) -> str:
            key = _flat_name(name)
            if key in seen:
                raise ValueError(
                    f"twin: reference names {seen[key]!r} and {name!r} both "
                    f"become {key!r}"
                )
            seen[key] = name
            return key

        names = []
        for name, p in reference.named_parameters():
            data = torch.empty(p.shape, dtype=p.dtype)
            bound = 1 / math.sqrt(max(_fan_in(p), 1))
            with torch.no_grad():
                data.uniform_(-bound, bound)
            self.register_parameter(
                flat(name), nn.Parameter(data, requires_grad=p.requires_grad)
            )
            names.append(name)
        if not names:
            raise ValueError(
                f"twin: {type(reference).__name__} has no parameters to mirror"
            )
        self.reference_names = tuple(names)
        self._head = _classifier(reference, num_classes)
        for name, b in reference.named_buffers():
            self.register_buffer(flat(name), torch.zeros(b.shape, dtype=b.dtype))
        # a step of 1/sqrt(L) keeps the chain of L near-identity updates
        # from growing or vanishing, whatever the depth
        self._step = 1 / math.sqrt(len(names))
        self._constants: dict[tuple[torch.device, torch.dtype], tuple] = {}

    def _fixed(self, device: torch.device, dtype: torch.dtype) -> tuple:
        """The projection in, its offset and the projection out, cached per device."""
        key = (device, dtype)
        if key not in self._constants:
            gen = torch.Generator().manual_seed(self.seed)
            n, d = math.prod(self.sample_shape), self.width
            proj = torch.randn(n, d, generator=gen) / math.sqrt(n)
            # the offset keeps gradients dense for an all-zero batch as well
            offset = torch.randn(d, generator=gen)
            out = torch.randn(d, self.num_classes, generator=gen) / math.sqrt(d)
            k = self._head[2] if self._head else 1
            features = torch.randn(n, k, generator=gen) * math.sqrt(2.0 / n)
            self._constants[key] = tuple(
                t.to(device=device, dtype=dtype) for t in (proj, offset, out, features)
            )
        return self._constants[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(len(x), -1)
        proj, offset, out, features = self._fixed(flat.device, flat.dtype)
        z = flat @ proj + offset
        h = z.mean(0)
        d = self.width
        for p in self.parameters():
            m = p.numel()
            if m == 0:
                continue
            k = _fan_in(p)
            v = h[:k] if k <= d else h.repeat(-(-k // d))[:k]
            y = p.reshape(m // k, k) @ v
            pad = -len(y) % d
            if pad:
                y = F.pad(y, (0, pad))
            h = h + self._step * torch.tanh(y.view(-1, d).mean(0))
        logits = (z + h) @ out
        if self._head:
            weight, bias, _ = self._head
            params = dict(self.named_parameters())
            logits = logits + F.linear(
                torch.relu(flat @ features),
                params[weight],
                params[bias] if bias else None,
            )
        return logits


def _classifier(reference: nn.Module, num_classes: int) -> tuple | None:
    """``(weight, bias or None, k)`` (flattened names) when the reference's
    last parameters are a ``(num_classes, k)`` classifier; else ``None``."""
    named = list(reference.named_parameters())
    bias = None
    if named and tuple(named[-1][1].shape) == (num_classes,):
        bias = _flat_name(named.pop()[0])
    if named and named[-1][1].dim() == 2 and named[-1][1].shape[0] == num_classes:
        return _flat_name(named[-1][0]), bias, int(named[-1][1].shape[1])
    return None


def twin(
    reference: nn.Module,
    sample_shape: tuple[int, ...],
    num_classes: int,
    *,
    width: int = 64,
    seed: int = 0,
) -> ShapeTwin:
    """The :class:`ShapeTwin` of ``reference`` for samples of ``sample_shape``."""
    return ShapeTwin(reference, sample_shape, num_classes, width=width, seed=seed)


def _twin_of(factory, sample_shape: tuple[int, ...], num_classes: int) -> ShapeTwin:
    # the reference only lends its shapes: on the meta device it allocates
    # no memory and initialises nothing
    with torch.device("meta"):
        reference = factory(sample_shape, num_classes)
    return twin(reference, sample_shape, num_classes)


def resnet18_twin(sample_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The shape twin of :func:`resnet18` (timing and communication only)."""
    return _twin_of(resnet18, sample_shape, num_classes)


def resnet50_twin(sample_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The shape twin of :func:`resnet50` (timing and communication only)."""
    return _twin_of(resnet50, sample_shape, num_classes)


def gpt2_twin(sample_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The shape twin of :func:`gpt2` (timing and communication only)."""
    return _twin_of(gpt2, sample_shape, num_classes)
