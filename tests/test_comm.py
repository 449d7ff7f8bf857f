"""The communicator wrapper under real MPI."""

import resource
import time

import numpy as np
import pytest
import torch

RANKS = [1, 2, 3, 4, 5]


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.mpi(ranks=1, timeout=60)
def test_as_buffer_is_zero_copy_and_checks_input():
    from mpi4py import MPI

    from hybridagg.comm import as_buffer, mpi_dtype

    t = torch.arange(6, dtype=torch.float32)
    buf, count, dtype = as_buffer(t)
    assert count == 6 and dtype == MPI.FLOAT
    view = np.frombuffer(buf, dtype=np.float32)
    view[2] = 42.0  # writing through the buffer changes the tensor itself
    assert t[2].item() == 42.0
    a = np.zeros(3, dtype=np.int64)
    assert as_buffer(a)[0] is a and as_buffer(a)[2] == MPI.INT64_T
    assert mpi_dtype(torch.float64) == MPI.DOUBLE
    with pytest.raises(ValueError, match="contiguous"):
        as_buffer(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="no MPI datatype"):
        as_buffer(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"torch\.Tensor or numpy"):
        as_buffer([1, 2, 3])


@pytest.mark.mpi(ranks=RANKS, timeout=90)
def test_collectives_match_a_local_reference():
    from hybridagg.comm import Comm

    comm = Comm(name="t")
    n = comm.size
    x = torch.arange(1000, dtype=torch.float64) * (comm.rank + 1)
    ptr = x.data_ptr()
    comm.Allreduce(x)
    assert x.data_ptr() == ptr
    torch.testing.assert_close(
        x, torch.arange(1000, dtype=torch.float64) * n * (n + 1) / 2
    )

    y = torch.full((5,), float(comm.rank))
    comm.Bcast(y, root=n - 1)
    assert torch.all(y == n - 1)

    gathered = comm.allgather({"rank": comm.rank, "pad": "x" * comm.rank * 100})
    assert [g["rank"] for g in gathered] == list(range(n))
    assert comm.bcast(("hello", comm.rank), root=0) == ("hello", 0)

    out = torch.zeros(n, 2)
    comm.Allgather(torch.full((2,), float(comm.rank)), out)
    assert out[:, 0].tolist() == list(range(n))

    sub = comm.split(comm.rank % 2, name="parity")
    assert sub.size == len(range(comm.rank % 2, n, 2))
    total = sub.Allreduce(np.array([comm.rank], dtype=np.int64))
    assert total[0] == sum(range(comm.rank % 2, n, 2))
    sub.free()
    comm.free()


@pytest.mark.mpi(ranks=[1, 2, 3], timeout=60)
def test_object_methods_refuse_buffers_and_name_the_buffer_method():
    """mpi4py's convention: lower case moves objects, upper case buffers."""
    from hybridagg.comm import Comm

    with Comm(name="names") as comm:
        t, a = torch.zeros(3), np.zeros(3)
        for method, buffer_method in [("allgather", "Allgather"), ("bcast", "Bcast")]:
            for x in (t, a):
                with pytest.raises(TypeError, match=rf"use Comm\.{buffer_method}"):
                    getattr(comm, method)(x)
        with pytest.raises(TypeError, match=r"use Comm\.Allreduce"):
            comm.allreduce(t)
        with pytest.raises(TypeError, match=r"use Comm\.Isend"):
            comm.isend(a, 0)
        with pytest.raises(TypeError, match=r"use Comm\.Irecv"):
            comm.recv(t)
        # objects: reduced in rank order, the same everywhere
        assert comm.allreduce(comm.rank + 1) == comm.size * (comm.size + 1) // 2
        assert comm.allreduce([comm.rank]) == list(range(comm.size))
        assert comm.allreduce(2, op=max) == 2
    comm.free()  # a second release does nothing


@pytest.mark.mpi(ranks=1, timeout=60)
def test_the_timeout_must_be_finite(monkeypatch):
    from hybridagg.comm import default_timeout

    for bad in ("nan", "inf", "0", "-1"):
        monkeypatch.setenv("HYBRIDAGG_TIMEOUT", bad)
        with pytest.raises(ValueError, match="HYBRIDAGG_TIMEOUT must be a finite"):
            default_timeout()
    monkeypatch.setenv("HYBRIDAGG_TIMEOUT", "2.5")
    assert default_timeout() == 2.5


@pytest.mark.mpi(ranks=[2, 3], timeout=60)
def test_point_to_point_ring():
    from hybridagg.comm import Comm

    comm = Comm(name="ring")
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out = torch.full((100,), float(comm.rank))
    inbox = torch.empty(100)
    reqs = [comm.Irecv(inbox, left, tag=7), comm.Isend(out, right, tag=7)]
    comm.wait(reqs, "ring exchange")
    assert torch.all(inbox == left)


@pytest.mark.mpi(ranks=1, timeout=60)
def test_a_wait_keeps_polling_a_service_until_its_requests_complete():
    # the service here is what completes the wait: a send that only the
    # poll posts, so a wait that never called it would time out
    from hybridagg.comm import Comm

    comm = Comm(name="self", timeout=10)
    inbox, out = torch.zeros(3), torch.arange(3.0)
    calls, sent = [0], []

    def poll() -> None:
        calls[0] += 1
        if calls[0] == 5:
            sent.append(comm.Isend(out, 0, tag=3))

    comm.wait(comm.Irecv(inbox, 0, tag=3), "a message the poll sends", poll=poll)
    assert calls[0] >= 5 and torch.equal(inbox, out)
    comm.wait(sent, "the send")
    calls[0] = 0
    comm.barrier(poll=poll)  # one rank: nothing to wait for, polled once
    assert calls[0] == 1


@pytest.mark.mpi(ranks=[1, 2, 3], timeout=60)
def test_error_on_one_rank_is_the_same_error_everywhere():
    from hybridagg.comm import Comm, RemoteError

    comm = Comm(name="check")
    comm.check(None)  # nobody failed: nothing raised
    bad = comm.size - 1
    err = ValueError("groups spec '0-9' names rank 9") if comm.rank == bad else None
    with pytest.raises(ValueError) as info:
        comm.check(err, what="spec validation")
    assert str(info.value) == f"[rank {bad}] groups spec '0-9' names rank 9"

    err = IsADirectoryError("data.h5 is a directory") if comm.rank == bad else None
    with pytest.raises(IsADirectoryError, match=r"\[rank \d\] data.h5 is a directory"):
        comm.check(err)

    class Custom(Exception):
        pass

    err = Custom("odd") if comm.rank == 0 else None
    with pytest.raises(RemoteError, match=r"\[rank 0\] Custom: odd"):
        comm.check(err)


@pytest.mark.mpi(ranks=2, timeout=60)
def test_wait_times_out_with_the_operation_named():
    from hybridagg.comm import Comm, CommTimeoutError

    comm = Comm(name="lonely", timeout=0.5)
    if comm.rank == 0:
        buf = torch.empty(4)
        req = comm.Irecv(buf, source=1, tag=99)  # rank 1 never sends this
        with pytest.raises(CommTimeoutError, match="never-sent message on lonely"):
            comm.wait(req, "never-sent message")
        req.Cancel()
    comm.barrier(timeout=30)


@pytest.mark.mpi(ranks=2, timeout=60)
def test_idle_wait_costs_well_under_a_tenth_of_a_core():
    from hybridagg.comm import Comm

    comm = Comm(name="idle")
    comm.barrier()
    if comm.rank == 1:
        time.sleep(2.0)  # the peer sleeps; rank 0 waits for it
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    comm.barrier(what="barrier with a sleeping peer")
    cpu, wall = cpu_seconds() - cpu0, time.perf_counter() - wall0
    if comm.rank == 0:
        assert wall > 1.5
        assert cpu / wall < 0.10, f"idle wait used {cpu / wall:.1%} of a core"


@pytest.mark.mpi(ranks=1, timeout=60)
def test_configure_threads(monkeypatch):
    from hybridagg.comm import configure_threads

    monkeypatch.delenv("HYBRIDAGG_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert configure_threads() == 1 and torch.get_num_threads() == 1
    monkeypatch.setenv("HYBRIDAGG_NUM_THREADS", "2")
    assert configure_threads() == 2 and torch.get_num_threads() == 2
    assert configure_threads(1) == 1
    with pytest.raises(ValueError, match="threads"):
        configure_threads(0)


class _FakeClock:
    """Stands in for ``time`` inside hybridagg.comm.waits: sleeping advances it."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def perf_counter(self):
        self.now += 1e-7  # each poll costs a little
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.mark.mpi(ranks=1, timeout=60)
def test_wait_until_max_sleep_lowers_the_back_off_cap_and_never_raises_it(monkeypatch):
    import hybridagg.comm.waits as comm_mod

    monkeypatch.setenv("HYBRIDAGG_POLL_MAX_SLEEP_US", "2000")
    monkeypatch.setenv("HYBRIDAGG_POLL_SPIN_US", "0")

    def longest_sleep(**kwargs):
        clock = _FakeClock()
        monkeypatch.setattr(comm_mod, "time", clock)
        waited = comm_mod.wait_until(lambda: clock.now >= 1.0, what="t", **kwargs)
        assert waited >= 1.0 and clock.sleeps
        return max(clock.sleeps)

    assert longest_sleep() == pytest.approx(2e-3)  # the back-off reaches the cap
    assert longest_sleep(max_sleep=200e-6) == pytest.approx(200e-6)
    assert longest_sleep(max_sleep=1.0) == pytest.approx(2e-3)  # never above the cap
    assert longest_sleep(max_sleep=0.0) == pytest.approx(10e-6)  # the floor
    monkeypatch.setenv("HYBRIDAGG_POLL_MAX_SLEEP_US", "5")  # a cap below the floor
    assert longest_sleep(max_sleep=200e-6) == pytest.approx(5e-6)
    monkeypatch.setenv("HYBRIDAGG_POLL_MAX_SLEEP_US", "2000")
    # the low cap lifts after 0.5 s of idleness: the general cap again
    assert longest_sleep(max_sleep=200e-6, max_sleep_for=0.5) == pytest.approx(2e-3)
    assert longest_sleep(max_sleep=200e-6, max_sleep_for=5.0) == pytest.approx(200e-6)


@pytest.mark.mpi(ranks=1, timeout=60)
def test_comm_wait_for_passes_max_sleep_and_activity_on(monkeypatch):
    import hybridagg.comm.communicator as comm_mod

    seen = {}

    def fake_poll(done, **kwargs):
        seen.update(kwargs)
        return 0.0

    comm = comm_mod.Comm(name="svc", timeout=7.0)
    monkeypatch.setattr(comm_mod, "wait_until", fake_poll)
    counter = lambda: 3  # noqa: E731
    comm.wait_for(
        lambda: True, "next push", activity=counter, max_sleep=5e-4, max_sleep_for=0.1
    )
    assert seen["max_sleep"] == 5e-4 and seen["activity"] is counter
    assert seen["max_sleep_for"] == 0.1
    assert seen["timeout"] == 7.0 and "next push on svc" in seen["what"]


@pytest.mark.mpi(ranks=1, timeout=60)
def test_server_max_sleep_reads_and_checks_its_variable(monkeypatch):
    from hybridagg.ps.server import server_max_sleep

    monkeypatch.delenv("HYBRIDAGG_SERVER_MAX_SLEEP_US", raising=False)
    assert server_max_sleep() == pytest.approx(500e-6)
    monkeypatch.setenv("HYBRIDAGG_SERVER_MAX_SLEEP_US", "50")
    assert server_max_sleep() == pytest.approx(50e-6)
    for bad in ("0", "-5"):
        monkeypatch.setenv("HYBRIDAGG_SERVER_MAX_SLEEP_US", bad)
        with pytest.raises(ValueError, match="HYBRIDAGG_SERVER_MAX_SLEEP_US"):
            server_max_sleep()
    monkeypatch.setenv("HYBRIDAGG_SERVER_MAX_SLEEP_US", "fast")
    with pytest.raises(ValueError, match="HYBRIDAGG_SERVER_MAX_SLEEP_US"):
        server_max_sleep()


@pytest.mark.mpi(ranks=1, timeout=60)
def test_a_waiting_server_costs_well_under_a_tenth_of_a_core():
    from hybridagg.comm import wait_until
    from hybridagg.ps.server import server_max_sleep

    end = time.perf_counter() + 2.0
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    wait_until(
        lambda: time.perf_counter() >= end, what="idle", max_sleep=server_max_sleep()
    )
    cpu, wall = cpu_seconds() - cpu0, time.perf_counter() - wall0
    assert wall > 1.5
    assert cpu / wall < 0.10, f"a server's idle wait used {cpu / wall:.1%} of a core"


@pytest.mark.mpi(ranks=1, timeout=60)
def test_server_threads_read_and_check_their_variable(monkeypatch):
    from hybridagg.ps.server import server_threads

    monkeypatch.delenv("HYBRIDAGG_SERVER_THREADS", raising=False)
    assert server_threads() is None  # the workers' setting stays
    monkeypatch.setenv("HYBRIDAGG_SERVER_THREADS", "3")
    assert server_threads() == 3
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv("HYBRIDAGG_SERVER_THREADS", bad)
        with pytest.raises(ValueError, match="HYBRIDAGG_SERVER_THREADS"):
            server_threads()


@pytest.mark.mpi(ranks=3, timeout=60)
def test_a_counter_host_answers_from_a_thread_while_its_rank_cannot_poll():
    """Server 0's start-up: the host's own thread answers the clients' draws
    while its main thread waits for something only those draws unblock."""
    from hybridagg.comm import Comm
    from hybridagg.comm.counter import CounterHost, ServedCounter

    comm = Comm(name="test")
    clients = comm.split(0 if comm.rank < 2 else None, comm.rank, name="clients")
    if comm.rank == 2:
        host = CounterHost(comm, [0, 1])
        with host.background():
            # no poll here: each client reports after its ten draws, which
            # only the thread can have answered
            done = [comm.recv(c, tag=5, what="client's draws") for c in (0, 1)]
        assert sorted(done[0] + done[1]) == list(range(20)), done
        # the main thread's turn (the server's loop): the clients' set
        comm.barrier(what="clients set the counter", poll=host.poll)
        assert host.value == 7
        host.close()
    else:
        counter = ServedCounter(comm, 2, clients)
        mine = [counter.fetch_add() for _ in range(10)]
        req, _buf = comm.isend(mine, 2, tag=5)
        comm.wait(req, "the report")
        counter.set(7)
        comm.barrier(what="clients set the counter")
        clients.free()
    comm.free()
