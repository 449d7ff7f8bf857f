"""``hybridagg train``'s configuration and the command line generated from it."""

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from hybridagg.train.config import (
    ALLREDUCE_BACKENDS,
    CONCERNS,
    WIRE_FORMATS,
    OptimOptions,
    TrainConfig,
)
from hybridagg.train.flags import config_from_args, field_docs, option_strings

ROOT = Path(__file__).resolve().parents[1]

# The published flags of `hybridagg train`. A change here is a change of the
# command line that users, scripts and the Slurm templates rely on.
FLAGS = [
    "--accept-config-changes",
    "--accumulate",
    "--adaptive-batch",
    "--adaptive-groups",
    "--allreduce-backend",
    "--amp",
    "--batch-deadband",
    "--batch-first-window",
    "--batch-probe",
    "--batch-shift",
    "--batch-shift-steps",
    "--batch-size",
    "--batch-smoothing",
    "--batch-window",
    "--checkpoint",
    "--checkpoint-every",
    "--chunk-counter",
    "--cost-budget",
    "--cost-slot",
    "--cost-v",
    "--damping",
    "--data",
    "--device",
    "--epochs",
    "--eval-every",
    "--groups",
    "--log-level",
    "--lookahead-horizon",
    "--loss",
    "--lr",
    "--max-batch",
    "--metrics",
    "--micro-batches",
    "--min-batch",
    "--mode",
    "--model",
    "--momentum",
    "--no-lookahead",
    "--no-progress",
    "--normalize",
    "--on-group-failure",
    "--optimizer",
    "--overlap",
    "--overwrite-checkpoints",
    "--pipeline-groups",
    "--pipeline-init",
    "--pipeline-partition",
    "--pipeline-schedule",
    "--plan",
    "--prices",
    "--resume",
    "--sample-ms",
    "--save-model",
    "--seed",
    "--servers",
    "--slowdown",
    "--staleness-bound",
    "--steps",
    "--stream-push",
    "--summary",
    "--target-accuracy",
    "--tensorboard",
    "--warmup-updates",
    "--weight-decay",
    "--wire",
]


def test_the_configuration_imports_neither_torch_nor_mpi():
    code = (
        "import sys\n"
        "import hybridagg.train.config, hybridagg.train.flags, hybridagg.cli\n"
        "hybridagg.cli.build_parser()\n"
        "heavy = sorted({'torch', 'mpi4py.MPI'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_the_flags_are_exactly_the_published_ones():
    assert option_strings() == FLAGS


def test_every_field_has_a_docstring_and_one_concern():
    docs = field_docs()
    names = [f.name for concern in CONCERNS for f in fields(concern)]
    assert sorted(names) == sorted(f.name for f in fields(TrainConfig))
    assert len(names) == len(set(names)), "a field in two concerns"
    undocumented = [n for n in names if len(docs.get(n, "")) < 5]
    assert not undocumented, undocumented


def test_defaults_live_in_the_fields():
    from hybridagg.cli import build_parser

    args = build_parser().parse_args(["train", "--data", "x.h5"])
    built = config_from_args(args)
    assert built == TrainConfig(data="x.h5")
    for f in fields(TrainConfig):
        if f.name != "data":
            assert getattr(args, f.name) == f.default, f.name


def test_switches_turn_their_default_around():
    from hybridagg.cli import build_parser

    argv = ["train", "--data", "x", "--mode", "hybrid", "--overlap", "--no-progress"]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert cfg.overlap and not cfg.progress and cfg.lookahead


def test_help_shows_the_groups_and_the_defaults():
    from hybridagg.cli import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for title in (
        "what to train:",
        "how to aggregate:",
        "heterogeneity emulation:",
        "adaptive batch sizes (OmniLearn's controller):",
        "measuring and saving:",
    ):
        assert title in text
    flat = " ".join(text.split())
    assert "per worker (default 32)" in flat
    assert (
        "cnn, gpt2, gpt2-twin, mlp, resnet, resnet18, resnet18-twin, resnet50, "
        "resnet50-twin or package.module:factory (default mlp)"
    ) in flat
    assert "--no-progress turn off the progress bar" in flat


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"momentum": -0.5}, "--momentum must be >= 0, got -0.5"),
        ({"batch_window": 0}, "--batch-window must be >= 1, got 0"),
        ({"damping": "cube"}, "--damping must be one of inverse, sqrt, none"),
        ({"allreduce_backend": "nccl"}, "--allreduce-backend must be one of"),
        ({"wire": "fp8"}, "--wire must be one of fp32, bf16, fp16, got 'fp8'"),
        (
            {"wire": "bf16", "allreduce_backend": "horovod"},
            "--wire bf16 needs --allreduce-backend mpi or torch",
        ),
        ({"batch_smoothing": 0}, "--batch-smoothing must be in"),
        ({"batch_shift": -0.1}, "--batch-shift must be >= 0, got -0.1"),
        ({"batch_shift_steps": 0}, "--batch-shift-steps must be >= 1, got 0"),
        ({"adaptive_groups": True}, "--adaptive-groups needs --adaptive-batch"),
        ({"max_batch": 8}, "--batch-size 32 must lie within"),
        ({"resume": True}, "need --checkpoint DIR"),
        ({"overwrite_checkpoints": True}, "need --checkpoint DIR"),
        (
            {"checkpoint": "ck", "resume": True, "overwrite_checkpoints": True},
            "cannot be combined with --resume",
        ),
        ({"accept_config_changes": True}, "--accept-config-changes needs --resume"),
        ({"amp": "fp8"}, "--amp must be one of none, bf16, fp16, got 'fp8'"),
        ({"amp": "fp16"}, "--amp fp16 needs --device cuda"),
        (
            {"amp": "fp16", "device": "cuda", "mode": "hybrid", "stream_push": True},
            "--amp fp16 does not combine with --stream-push",
        ),
        ({"accumulate": 0}, "--accumulate must be >= 1, got 0"),
        ({"chunk_counter": "file"}, "--chunk-counter must be one of auto, window"),
        ({"chunk_counter": "server"}, "--chunk-counter needs --mode hybrid or async"),
        (
            {
                "mode": "async",
                "chunk_counter": "window",
                "on_group_failure": "continue",
            },
            "--on-group-failure continue needs --chunk-counter server",
        ),
        (
            {"mode": "hybrid", "chunk_counter": "server", "pipeline_groups": "all"},
            "--pipeline-groups does not combine with --chunk-counter",
        ),
    ],
)
def test_more_bad_values_name_their_flag(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(data="x.h5", **kw)


def test_a_concern_checks_itself_alone():
    assert OptimOptions(lr=0.1).lr == 0.1
    with pytest.raises(ValueError, match="--lr must be positive"):
        OptimOptions(lr=0)


def test_the_backends_are_the_optimizer_s():
    from hybridagg.optimizer.backends import BACKENDS

    assert ALLREDUCE_BACKENDS == BACKENDS


def test_the_wire_formats_are_the_codec_s():
    from hybridagg.comm.wire import WIRE_FORMATS as CODEC_FORMATS

    assert WIRE_FORMATS == CODEC_FORMATS


def test_the_wire_flag_parses_and_refuses_unknown_formats(capsys):
    from hybridagg.cli import build_parser

    parser = build_parser()
    argv = ["train", "--data", "x", "--wire", "bf16"]
    assert config_from_args(parser.parse_args(argv)).wire == "bf16"
    assert config_from_args(parser.parse_args(argv[:3])).wire == "fp32"
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["train", "--data", "x", "--wire", "fp8"])
    assert exc.value.code == 2
    assert "--wire" in capsys.readouterr().err


def test_the_zoo_names_every_factory():
    from hybridagg.train import architectures, models
    from hybridagg.train.zoo import MODELS

    homes = {m.__name__: m for m in (models, architectures)}
    for name, path in MODELS.items():
        module, _, attr = path.partition(":")
        assert module in homes and callable(getattr(homes[module], attr)), name
    assert {"resnet18", "resnet50", "gpt2"} <= MODELS.keys()
    assert {f"{n}-twin" for n in ("resnet18", "resnet50", "gpt2")} <= MODELS.keys()


@pytest.mark.parametrize("bad", ["nan", "inf", "-Infinity"])
def test_every_float_flag_must_be_finite(bad):
    """argparse's float takes nan and inf; a bound alone lets them through."""
    import typing

    from hybridagg.cli import build_parser

    hints = typing.get_type_hints(TrainConfig)
    floats = [
        f.name
        for f in fields(TrainConfig)
        if float in typing.get_args(hints[f.name]) or hints[f.name] is float
    ]
    assert {"lr", "momentum", "sample_ms", "weight_decay"} <= set(floats)
    for name in floats:
        flag = "--" + name.replace("_", "-")
        args = build_parser().parse_args(["train", "--data", "x.h5", f"{flag}={bad}"])
        with pytest.raises(ValueError, match=f"{flag} must be a finite number"):
            config_from_args(args)


def _cost(**extra):
    base = dict(
        data="d.h5",
        mode="sync",
        groups="0-1,2",
        pipeline_groups="0",
        adaptive_batch=True,
    )
    return TrainConfig(**{**base, **extra})


def test_cost_budget_needs_prices_and_a_pipelined_sync_job_with_adaptive_batches():
    cfg = _cost(cost_budget=10.0, prices="0-1:4,2:3")
    assert cfg.cost_budget == 10.0 and cfg.cost_slot == 20
    with pytest.raises(ValueError, match="--cost-budget needs --prices"):
        _cost(cost_budget=10.0)
    for extra in (
        {"adaptive_batch": False},
        {"pipeline_groups": None},
        {"mode": "hybrid", "servers": 1, "adaptive_batch": False},
    ):
        with pytest.raises(ValueError, match="--cost-budget needs --pipeline-groups"):
            _cost(cost_budget=10.0, prices="0-2:1", **extra)
    for name, value in (("prices", "0:1"), ("cost_v", 2.0), ("cost_slot", 5)):
        with pytest.raises(ValueError, match="is for --cost-budget"):
            _cost(**{name: value})
    with pytest.raises(ValueError, match="--cost-v must be positive"):
        _cost(cost_budget=1.0, prices="0-2:1", cost_v=0.0)
    with pytest.raises(ValueError, match="RANKS:PRICE"):
        _cost(cost_budget=1.0, prices="0-2")
    with pytest.raises(ValueError, match="names rank 1 twice"):
        _cost(cost_budget=1.0, prices="0-1:1,1:2")
    with pytest.raises(ValueError, match="must be a finite non-negative number"):
        _cost(cost_budget=1.0, prices="0-2:-1")


def test_rank_prices_from_items_or_a_cluster_file(tmp_path):
    from hybridagg.train.config.cost import rank_prices

    assert rank_prices("0-1:4,2:3.5", 3) == [4.0, 4.0, 3.5]
    with pytest.raises(ValueError, match=r"ranks \[2\] have no price"):
        rank_prices("0-1:4", 3)
    with pytest.raises(ValueError, match=r"ranks \[3\] are not workers"):
        rank_prices("0-3:4", 3)
    path = tmp_path / "c.yaml"
    path.write_text(
        "name: t\n"
        "links:\n"
        "  intra_node: {bandwidth: 50GB/s, latency: 2us}\n"
        "  inter_node: {bandwidth: 100Gb/s, latency: 5us}\n"
        "node_types:\n"
        "  - {name: fast, count: 1, devices: 2, speed: 1.0, price_per_hour: 8.0}\n"
        "  - {name: slow, count: 2, devices: 1, speed: 0.25, price_per_hour: 3.0}\n"
    )
    assert rank_prices(str(path), 3) == [4.0, 4.0, 3.0]
    with pytest.raises(ValueError, match="the cluster has 4 devices, the job 5"):
        rank_prices(str(path), 5)
    with pytest.raises(ValueError, match="no such cluster file"):
        rank_prices(str(tmp_path / "missing.yaml"), 3)


@pytest.mark.parametrize(
    "choice,mode,continues,pipelined,hosts,home",
    [
        ("auto", "sync", False, False, ["a", "b"], None),  # fixed shares
        ("auto", "hybrid", False, False, ["a", "a", "a"], "window"),
        ("auto", "hybrid", False, False, ["a", "a", "b"], "server"),
        ("auto", "async", False, False, [], "window"),  # no hosts known: one node
        ("window", "async", False, False, ["a", "b"], "window"),
        ("server", "async", False, False, ["a", "a"], "server"),
        ("auto", "async", True, False, ["a", "a"], "server"),  # a dead lock holder
        ("auto", "hybrid", False, True, ["a", "b"], "window"),  # the stages' loader
    ],
)
def test_the_chunk_counter_lives_on_a_window_within_a_node_and_on_server_0_across(
    choice, mode, continues, pipelined, hosts, home
):
    from hybridagg.train.chunks import counter_home

    assert (
        counter_home(
            choice,
            mode=mode,
            survives_group_loss=continues,
            pipelined=pipelined,
            worker_hosts=hosts,
        )
        == home
    )
