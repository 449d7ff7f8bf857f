"""Non-finite values: refused where they enter, and a clean stop (exit 3) where they arise.

Issue 19: NaN samples, ``--lr inf`` or ``--momentum nan`` trained to the end
and exited 0; ``HYBRIDAGG_TIMEOUT=nan`` disabled every timeout; a bad
``--device`` or a model that does not fit the data ended in a traceback.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from train_helpers import output, run_train

from hybridagg.comm.finite import all_finite
from hybridagg.runtime import envvars, runner
from hybridagg.runtime.outcomes import ExitCode

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ pure logic
def test_all_finite_is_exact_even_when_the_sum_overflows():
    x = torch.ones(1000)
    assert all_finite([x, torch.zeros(0)])
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[517] = bad
        assert not all_finite([x, y])
    # huge finite values overflow the float32 sum: the exact check confirms
    huge = torch.full((10,), 3e38)
    assert not torch.isfinite(huge.sum())
    assert all_finite([huge])
    both = torch.tensor([float("inf"), float("-inf")])  # sums to NaN
    assert not all_finite([both])


def test_nonfinite_losses_name_the_ranks():
    from hybridagg.train.worker.step import LOSS, nonfinite_losses

    shared = torch.zeros(3, LOSS + 1, dtype=torch.float64)
    shared[:, LOSS] = torch.tensor([0.5, 0.25, 0.0])
    assert nonfinite_losses(shared, [4, 5, 6]) is None
    shared[1, LOSS] = float("nan")
    assert nonfinite_losses(shared, [4, 5, 6]) == "the loss of rank 5 is nan"
    shared[2, LOSS] = float("inf")
    text = nonfinite_losses(shared, [4, 5, 6])
    assert "2 ranks" in text and "rank 5: nan" in text and "rank 6: inf" in text


def test_the_headers_carry_the_reason_of_a_stop():
    from hybridagg.ps import protocol as P
    from hybridagg.ps.groupweights import GROUP_HEAD_LEN, GroupHeader

    for reason in (None, 0, 3):
        head = np.zeros(P.REPLY_LEN)
        reply = P.Reply(version=7, stop=reason is not None, nonfinite=reason)
        assert P.Reply.decode(reply.encode_into(head)) == reply
        header = GroupHeader(stop=True, version=7, nonfinite=reason)
        buf = torch.zeros(GROUP_HEAD_LEN, dtype=torch.float64)
        assert GroupHeader.decode(header.encode_into(buf)) == header
    done = P.Request(P.DONE, 2, flags=P.FLAG_NONFINITE)
    back = P.Request.decode(done.encode(P.request_len(1)))
    assert back.flags & P.FLAG_NONFINITE and back.arg == 2


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"lr": float("inf")}, "--lr must be a finite number, got inf"),
        ({"momentum": float("nan")}, "--momentum must be a finite number"),
        ({"weight_decay": float("inf")}, "--weight-decay must be a finite"),
        ({"sample_ms": float("inf")}, "--sample-ms must be a finite number"),
        ({"batch_deadband": float("nan")}, "--batch-deadband must be a finite"),
        ({"target_accuracy": float("nan")}, "--target-accuracy must be a finite"),
        ({"lookahead_horizon": float("inf")}, "--lookahead-horizon must be a"),
        ({"slowdown": "0:inf"}, "slowdown factor inf must be a finite"),
        ({"slowdown": "0:2@nan"}, "slowdown start time nan must be a finite"),
        ({"device": "foo"}, "unknown --device 'foo'"),
        ({"device": "cuda:x"}, "unknown --device 'cuda:x'"),
    ],
)
def test_non_finite_and_unknown_options_are_named(kw, match):
    from hybridagg.train.config import TrainConfig

    with pytest.raises(ValueError, match=match):
        TrainConfig(data="x.h5", **kw)


@pytest.mark.parametrize(
    "name,value,match",
    [
        (
            "HYBRIDAGG_TIMEOUT",
            "nan",
            "HYBRIDAGG_TIMEOUT must be a finite number, got 'nan'",
        ),
        (
            "HYBRIDAGG_TIMEOUT",
            "inf",
            "HYBRIDAGG_TIMEOUT must be a finite number, got 'inf'",
        ),
        ("HYBRIDAGG_TIMEOUT", "0", "HYBRIDAGG_TIMEOUT must be positive"),
        (
            "HYBRIDAGG_POLL_SPIN_US",
            "nan",
            "HYBRIDAGG_POLL_SPIN_US must be a finite number, got 'nan'",
        ),
        (
            "HYBRIDAGG_SERVER_MAX_SLEEP_US",
            "inf",
            "HYBRIDAGG_SERVER_MAX_SLEEP_US must be a finite",
        ),
        ("HYBRIDAGG_RING_MIN_BYTES", "1e3", "is not an integer"),
        ("HYBRIDAGG_SHM_REDUCE", "maybe", "is not a boolean"),
    ],
)
def test_every_float_variable_must_be_finite(name, value, match):
    with pytest.raises(ValueError, match=match):
        envvars.check_all({name: value})
    if envvars.ENV_VARS[name].kind == "float" and "finite" in match:
        with pytest.raises(ValueError, match=name):
            envvars.get_float(name, {name: value})
    envvars.check_all({})  # the defaults are fine


def test_every_wait_keeps_a_finite_timeout():
    from hybridagg.comm import check_timeout

    assert check_timeout(2.5) == 2.5
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="must be a finite positive number"):
            check_timeout(bad)


def test_a_model_that_does_not_fit_the_data_names_both_shapes():
    from hybridagg.train.models import check_fits, resolve_device

    cpu = torch.device("cpu")
    check_fits(torch.nn.Linear(64, 10), (64,), 10, "ok", cpu)
    with pytest.raises(ValueError, match=r"shape \(64,\) \(it expects inputs of 32"):
        check_fits(torch.nn.Linear(32, 10), (64,), 10, "m:narrow", cpu)
    with pytest.raises(
        ValueError, match="outputs 3 values per sample, but the data has 10"
    ):
        check_fits(torch.nn.Linear(64, 3), (64,), 10, "m:few", cpu)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten())
    with pytest.raises(
        ValueError, match=r"\(1, 8, 8\) \(it expects inputs of 3 channels"
    ):
        check_fits(conv, (1, 8, 8), 10, "m:rgb", cpu)
    bn = torch.nn.Sequential(torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 10))
    before = bn[0].running_mean.clone()
    check_fits(bn, (64,), 10, "bn", cpu)
    assert bn.training and torch.equal(bn[0].running_mean, before)  # untouched
    with pytest.raises(ValueError, match="'foo' is not a device"):
        resolve_device("foo", 0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available on rank 3"):
            resolve_device("cuda", 3)


def test_convert_refuses_non_finite_samples_unless_allowed(tmp_path):
    from hybridagg.data import convert_arrays

    x = np.random.default_rng(0).random((300, 4)).astype(np.float32)
    x[123, 2] = np.nan
    x[200, 0] = np.inf
    y = np.arange(300) % 3
    with pytest.raises(
        ValueError, match=r"arrays: sample 123 is not finite \(holds nan\)"
    ):
        convert_arrays(x, y, tmp_path / "a.h5")
    assert not (tmp_path / "a.h5").exists()
    out = convert_arrays(x, y, tmp_path / "a.h5", allow_nonfinite=True)
    import h5py

    with h5py.File(out) as f:
        # the normalisation statistics come from the finite values
        assert np.isfinite(f.attrs["norm_mean"]).all()
        assert np.isfinite(f.attrs["norm_std"]).all()
        rows = np.concatenate([f["train/samples"][:], f["val/samples"][:]])
        assert np.isnan(rows).sum() == 1 and np.isinf(rows).sum() == 1
    # the command line: exit 2, naming the source and the sample
    np.savez(tmp_path / "d.npz", x=x, y=y)
    cli = [sys.executable, "-m", "hybridagg.cli", "convert", "--from", "npz"]
    cli += [str(tmp_path / "d.npz"), "--out", str(tmp_path / "d.h5"), "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "npz:d.npz: sample 123 is not finite" in done.stderr
    done = subprocess.run(
        [*cli, "--allow-nonfinite"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------- the command line, no MPI
def _cli(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "hybridagg.cli", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args,env,match",
    [
        (["--lr", "inf"], {}, "--lr must be a finite number, got inf"),
        (["--momentum", "nan"], {}, "--momentum must be a finite number, got nan"),
        (["--sample-ms", "inf"], {}, "--sample-ms must be a finite number"),
        (["--device", "foo"], {}, "unknown --device 'foo'"),
        (
            [],
            {"HYBRIDAGG_TIMEOUT": "nan"},
            "HYBRIDAGG_TIMEOUT must be a finite number, got 'nan'",
        ),
        (
            [],
            {"HYBRIDAGG_TIMEOUT": "inf"},
            "HYBRIDAGG_TIMEOUT must be a finite number, got 'inf'",
        ),
        (
            [],
            {"HYBRIDAGG_POLL_SPIN_US": "nan"},
            "HYBRIDAGG_POLL_SPIN_US must be a finite number, got 'nan'",
        ),
    ],
)
def test_train_refuses_non_finite_input_with_exit_2(args, env, match):
    """Before MPI starts: the same verdict on every rank (here rank 0 alone)."""
    done = _cli(["train", "--data", "x.h5", *args], env)
    assert done.returncode == ExitCode.BAD_INPUT, done.stderr
    assert match in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_other_subcommands_refuse_non_finite_floats():
    done = _cli(["run", "-n", "1", "--timeout", "inf", "--dry-run", "--", "true"])
    assert (
        done.returncode == 2 and "argument --timeout: must be a finite" in done.stderr
    )
    done = _cli(
        ["convert", "--from", "digits", "--out", "x.h5", "--val-fraction", "nan"]
    )
    assert done.returncode == 2 and "--val-fraction: must be a finite" in done.stderr


# ---------------------------------------------------------------- MPI: servers
@pytest.mark.mpi(ranks=2, timeout=120)
def test_a_server_refuses_a_non_finite_push():
    """A leader that does not check (a bare PSClient) cannot poison the model."""
    import hybridagg
    from hybridagg.ps.client import PSClient
    from hybridagg.ps.compensation import Compensation

    topo = hybridagg.init(groups="0", servers=1)
    if topo.is_server:
        stats = hybridagg.serve(topo)
        assert stats.nonfinite == 0
        assert stats.updates_per_leader == [2]  # received, the second not applied
        return
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.SGD(params, lr=0.1)
    client = PSClient(topo.comms.leaders.dup("ps"), 1, params, [], opt, Compensation())
    start = client.flat_weights.clone()
    good = client.complete(client.push([torch.ones(6), torch.ones(3)], 1.0, [0.1], [0]))
    assert good["nonfinite"] is None and not good["stop"]
    after_good = client.flat_weights.clone()
    torch.testing.assert_close(after_good, start - 0.1)
    bad = [torch.ones(6), torch.tensor([1.0, float("nan"), 1.0])]
    client.complete(client.push(bad, 1.0, [0.1], good["versions"]))
    # the reply header to the refused push may have left before the bad
    # part arrived; any later reply carries the stop and its reason
    later = client.complete(client.pull())
    assert later["stop"] and later["nonfinite"] == 0
    torch.testing.assert_close(client.flat_weights, after_good)
    client.done()
    client.receive_final()
    torch.testing.assert_close(client.flat_weights, after_good)
    assert torch.isfinite(client.flat_weights).all()


@pytest.mark.mpi(ranks=2, timeout=120)
def test_a_leader_does_not_push_a_non_finite_gradient():
    import hybridagg

    topo = hybridagg.init(groups="0", servers=1)
    if topo.is_server:
        stats = hybridagg.serve(topo)
        assert stats.updates_per_leader == [1]  # the finite step only
        assert stats.nonfinite == 0  # told by the leader's DONE
        return
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        topo,
        mode="hybrid",
        model=model,
    )
    x = torch.randn(8, 4)
    for step, scale in enumerate((1.0, float("nan"))):
        opt.zero_grad()
        (model(x * scale).sum()).backward()
        opt.step()
        if step == 0:
            assert opt.nonfinite is None and not opt.should_stop
            assert opt.server_version == 1
            kept = [p.detach().clone() for p in model.parameters()]
    assert opt.should_stop and opt.server_version == 1
    assert "the reduced gradient of group 0 (rank 0) is not finite" in opt.nonfinite
    assert "nothing was pushed" in opt.nonfinite
    for p, k in zip(model.parameters(), kept, strict=True):
        assert torch.equal(p.detach(), k)
    opt.finish()
    for p, k in zip(model.parameters(), kept, strict=True):
        assert torch.equal(p.detach(), k)  # the servers' final weights: finite


@pytest.mark.mpi(ranks=2, timeout=120)
def test_a_streamed_push_is_cut_short_at_its_first_non_finite_bucket(monkeypatch):
    """The bias's bucket is final (and pushed) first; the weight's is NaN."""
    import hybridagg

    monkeypatch.setenv("HYBRIDAGG_PS_PART_BYTES", "8")  # the bias alone in a part
    topo = hybridagg.init(groups="0", servers=1)
    if topo.is_server:
        stats = hybridagg.serve(topo)
        assert stats.nonfinite == 0  # told by the leader's DONE
        return
    model = torch.nn.Linear(4, 2)
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        topo,
        mode="hybrid",
        model=model,
        bucket_mb=4 / 2**20,  # one bucket per parameter
        stream_push=True,
    )
    weight, bias = (p.detach().clone() for p in model.parameters())
    x = torch.ones(3, 4)
    x[0, 0] = float("nan")  # the weight's gradient; the bias's stays finite
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    assert opt.should_stop
    assert "its push was cut short after 1 parts" in opt.nonfinite, opt.nonfinite
    opt.finish()
    # the servers' final weights: the bias's part applied, nothing after it
    assert torch.equal(model.weight.detach(), weight)
    # (the bias's gradient: 3 samples' summed outputs)
    torch.testing.assert_close(model.bias.detach(), bias - 0.1 * 3)


@pytest.mark.mpi(ranks=2, timeout=120)
def test_sync_skips_the_update_on_every_rank():
    import hybridagg

    topo = hybridagg.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), topo
    )
    from hybridagg.comm import Comm

    world = Comm(name="test")
    # only rank 1's gradient is NaN; the reduced one is, on every rank
    scale = float("nan") if world.rank == 1 else 1.0
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    (model(torch.randn(8, 4) * scale).sum()).backward()
    opt.step()
    assert opt.should_stop and opt.nonfinite == "the reduced gradient is not finite"
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)
    assert opt.updates == 0
    opt.finish()
    world.free()


# ---------------------------------------------------- hybridagg train, end to end
@pytest.fixture(scope="module")
def nan_digits(tmp_path_factory):
    """The digits with NaN in a few samples, kept by --allow-nonfinite."""
    from sklearn.datasets import load_digits

    from hybridagg.data import convert_arrays

    d = load_digits()
    x = d.data.astype(np.float32)
    x[::60, 5] = np.nan  # 30 of 1797 samples
    path = tmp_path_factory.mktemp("data") / "nan-digits.h5"
    convert_arrays(x, d.target, path, num_classes=10, allow_nonfinite=True)
    return str(path)


def run_recording_exit_codes(nranks: int, args: list[str], folder: Path, timeout=240):
    """Run ``hybridagg train`` with every rank's exit code written to ``folder``.

    Open MPI 5's launcher otherwise ends the other ranks at the first non-zero
    exit, so a rank's own code would be lost.
    """
    folder.mkdir()
    record = (
        f'"{sys.executable}" -m hybridagg.cli train "$@"; c=$?; '
        f'echo $c > "{folder}/rank-${{OMPI_COMM_WORLD_RANK:-$PMI_RANK}}"; exit $c'
    )
    argv = runner.mpiexec_argv(nranks, ["sh", "-c", record, "sh", *args])
    env = runner.mpiexec_env()
    env["HYBRIDAGG_TIMEOUT"] = "60"
    env["PRTE_MCA_state_base_error_non_zero_exit"] = "0"
    result = runner.run_job(argv, timeout=timeout, env=env)
    assert not result.timed_out, output(result)[-3000:]
    codes = {int(p.name.split("-")[1]): int(p.read_text()) for p in folder.iterdir()}
    return result, codes


def test_nan_data_stops_every_rank_in_sync_with_exit_3(nan_digits, tmp_path):
    result, codes = run_recording_exit_codes(
        2, ["--data", nan_digits, "--no-progress", "--epochs", "2"], tmp_path / "codes"
    )
    text = output(result)
    assert codes == {0: 3, 1: 3}, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert text.count("hybridagg train: stopped: step ") == 1, text[-3000:]
    assert "loss" in text and "nan" in text and "not finite" in text, text[-3000:]


@pytest.mark.parametrize("counter", ["auto", "server"])
def test_nan_data_stops_every_group_and_the_server_in_hybrid(
    nan_digits, tmp_path, counter
):
    # with the chunk counter on server 0 the stop goes through its drain:
    # the server answers the loaders' last draws until every worker joins
    args = ["--data", nan_digits, "--no-progress", "--epochs", "3"]
    args += ["--mode", "hybrid", "--groups", "0-1,2", "--servers", "1"]
    args += ["--chunk-counter", counter]
    args += [
        "--metrics",
        str(tmp_path / "m.jsonl"),
        "--checkpoint",
        str(tmp_path / "ck"),
    ]
    result, codes = run_recording_exit_codes(4, args, tmp_path / "codes")
    text = output(result)
    assert codes == {0: 3, 1: 3, 2: 3, 3: 3}, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert text.count("hybridagg train: stopped: step ") == 1, text[-3000:]
    assert "nothing was pushed" in text and "group " in text, text[-3000:]
    # no checkpoint was published after the stop
    assert not list((tmp_path / "ck").glob("ckpt-*")), list((tmp_path / "ck").iterdir())


def test_a_model_that_does_not_fit_or_a_missing_device_is_one_clear_error(
    tmp_path, nan_digits
):
    (tmp_path / "narrow.py").write_text(
        "import torch\n\ndef model():\n    return torch.nn.Linear(32, 10)\n\n"
        "def few():\n    return torch.nn.Linear(64, 3)\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', ROOT)}"}
    base = ["--data", nan_digits, "--no-progress", "--steps", "2"]
    cases = [
        (
            ["--model", "narrow:model"],
            r"cannot take samples of shape \(64,\) \(it "
            r"expects inputs of 32 features\)",
        ),
        (["--model", "narrow:few"], "outputs 3 values per sample, but the data has 10"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "--device cuda: CUDA is not available"))
    import re

    for extra, match in cases:
        result = run_train(2, [*base, *extra], env=env, timeout=120)
        text = output(result)
        assert result.returncode == ExitCode.BAD_INPUT, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        assert re.search(match, text), text[-3000:]
        assert text.count("hybridagg train: error:") == 1, text[-3000:]


@pytest.mark.parametrize("mode", ["sync", "hybrid"])
def test_nan_data_stops_a_job_with_a_pipelined_group(nan_digits, tmp_path, mode):
    """A pipelined group's NaN loss stops every rank at one step (exit 3, one message)."""
    args = ["--data", nan_digits, "--no-progress", "--epochs", "3", "--mode", mode]
    args += ["--groups", "0-1,2", "--pipeline-groups", "0"]
    nranks = 3 if mode == "sync" else 4
    if mode == "hybrid":
        args += ["--servers", "1"]
    result, codes = run_recording_exit_codes(nranks, args, tmp_path / "codes")
    text = output(result)
    assert codes == dict.fromkeys(range(nranks), 3), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert text.count("hybridagg train: stopped: step ") == 1, text[-3000:]
    assert "not finite" in text, text[-3000:]
