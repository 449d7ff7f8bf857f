"""The server role's start: server 0 keeps answering chunk draws while it
waits at the start barrier (the workers' loaders read ahead from before it)."""

from __future__ import annotations

from types import SimpleNamespace

from hybridagg.train.server_role import _ServerEvents


class _World:
    """A world whose barrier records its arguments and lets a draw arrive."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def barrier(self, *, what: str, timeout=None, poll=None) -> None:
        self.calls.append((what, poll))
        if poll is not None:
            poll()  # a loader's draw arrives while the others are on their way


def _events(poll):
    world = _World()
    topo = SimpleNamespace(comms=SimpleNamespace(world=world))
    return _ServerEvents(None, topo, None, None, poll), world


def test_server_0_answers_chunk_draws_while_it_waits_to_start():
    answered: list[int] = []
    events, world = _events(lambda: answered.append(1))
    events.on_ready()
    assert [what for what, _ in world.calls] == ["start of training"]
    assert answered == [1]
    assert events.start > 0


def test_other_servers_wait_to_start_without_a_counter():
    events, world = _events(None)
    events.on_ready()
    assert world.calls == [("start of training", None)]
