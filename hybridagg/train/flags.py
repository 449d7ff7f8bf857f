"""``hybridagg train``'s command line, generated from the configuration's fields.

Every flag comes from one field of :class:`~hybridagg.train.config.TrainConfig`
(walked concern by concern, :data:`~hybridagg.train.config.CONCERNS`), so a
default, a type or a description lives in one place:

* the flag is the field's name with dashes (:func:`~hybridagg.train.config.flag`);
  a boolean is a switch that turns its default around: ``--overlap`` for a
  field that defaults to false, ``--no-lookahead`` for one that defaults to
  true;
* the type is the field's annotation without ``None``; ``str`` needs none;
* the default is the field's (a field without one is a required flag), shown
  in the help unless it is ``None`` or a switch's;
* the help is the first paragraph of the field's docstring (``metadata["help"]``
  when it must be computed); a ``--no-NAME`` switch says "turn off" before it;
* ``metadata["choices"]`` become the flag's choices; ``metadata["short"]``
  (``option(short="-n")``) a one-letter alias beside the long flag;
* each concern's ``help_group`` is its group in ``--help``.

Plain ``argparse`` rather than a library that builds parsers from dataclasses
(tyro, jsonargparse): those spell booleans, ``None`` defaults and help groups
their own way, and the flags are a published interface that must not change.
Attribute docstrings are not kept at run time, so they are read from this
configuration's source (``ast``), once per process.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import sys
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, Field, fields
from typing import Any

from .config import CONCERNS, TrainConfig, flag

__all__ = [
    "add_arguments",
    "config_from_args",
    "field_docs",
    "given_fields",
    "option_strings",
]


@functools.cache
def _class_docs() -> dict[str, dict[str, str]]:
    """Each concern's fields' docstrings (the string literal after the field),
    by class name: two commands' concerns may document a name differently."""
    # (here, not at import: hybridagg train needs no simulation's concerns)
    from .config.simulation import PLAN_CONCERNS, PROFILE_CONCERNS, SIMULATE_CONCERNS

    concerns = (*CONCERNS, *SIMULATE_CONCERNS, *PROFILE_CONCERNS, *PLAN_CONCERNS)
    modules = dict.fromkeys(sys.modules[c.__module__] for c in concerns)
    nodes = [n for m in modules for n in ast.walk(ast.parse(inspect.getsource(m)))]
    docs: dict[str, dict[str, str]] = {}
    for node in nodes:
        if not isinstance(node, ast.ClassDef):
            continue
        own = docs.setdefault(node.name, {})
        for stmt, after in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                own[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


@functools.cache
def field_docs() -> dict[str, str]:
    """Each ``hybridagg train`` field's docstring (the string literal after the field)."""
    docs: dict[str, str] = {}
    for concern in CONCERNS:
        docs.update(_class_docs().get(concern.__name__, {}))
    return docs


def _help(f: Field, owner: type, *, switch: bool) -> str | None:
    """The help of ``f``'s flag, documented in ``owner``; ``switch``: a boolean
    switch (no default shown)."""
    text = f.metadata.get("help")
    if text is None:
        doc = _class_docs().get(owner.__name__, {}).get(f.name)
        if doc is None:
            return None
        text = " ".join(doc.split("\n\n")[0].split())
    text = text.replace("%", "%%")  # argparse formats help with %
    if switch:
        return f"turn off {text}" if f.default else text
    if f.default is not MISSING and f.default is not None:
        text += " (default %(default)s)"
    return text


def _value_type(hint: Any) -> type | None:
    """The parser's ``type=`` for a field annotated ``hint`` (``None`` for ``str``)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return None if hint is str else hint


def _add(group: argparse._ArgumentGroup, f: Field, hint: Any, owner: type) -> None:
    names = [f.metadata["short"]] if "short" in f.metadata else []
    # a parser built with argument_default=SUPPRESS (given_fields) keeps it:
    # a default passed here would win over it
    suppress = group.argument_default is argparse.SUPPRESS
    if hint is bool:  # a switch that turns the default around
        name = "--no-" + flag(f.name)[2:] if f.default else flag(f.name)
        group.add_argument(
            *names,
            name,
            dest=f.name,
            action="store_false" if f.default else "store_true",
            help=_help(f, owner, switch=True),
        )
        return
    kwargs: dict[str, Any] = {"dest": f.name, "help": _help(f, owner, switch=False)}
    if f.default is MISSING:
        kwargs["required"] = True
    elif not suppress:
        kwargs["default"] = f.default
    value_type = _value_type(hint)
    if value_type is not None:
        kwargs["type"] = value_type
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    group.add_argument(*names, flag(f.name), **kwargs)


def add_arguments(
    p: argparse.ArgumentParser,
    config: type = TrainConfig,
    concerns: tuple[type, ...] = CONCERNS,
) -> None:
    """Add the options of ``hybridagg train`` to ``p``, one per configuration field.

    Args:
        p: The parser.
        config: The configuration class (``SimulateConfig`` for ``hybridagg
            simulate``); a field it redefines (its default) wins over the
            concern's.
        concerns: Its concerns, in the order of ``--help``.
    """
    hints = typing.get_type_hints(config)
    final = {f.name: f for f in fields(config)}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for concern in concerns:
        title = concern.help_group
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        for f in fields(concern):
            if f.name in final and final[f.name] is not f:
                # redefined by the configuration class: added once, by its concern
                owner = next(c for c in concerns if f.name in c.__dataclass_fields__)
                if owner is not concern:
                    continue
            _add(groups[title], final[f.name], hints[f.name], concern)


def option_strings(
    config: type = TrainConfig, concerns: tuple[type, ...] = CONCERNS
) -> list[str]:
    """Every flag of ``hybridagg train`` (or of ``config``), sorted (``-h``, ``--help`` left out)."""
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p, config, concerns)
    return sorted(s for a in p._actions for s in a.option_strings)


def given_fields(
    argv: Sequence[str],
    config: type = TrainConfig,
    concerns: tuple[type, ...] = CONCERNS,
) -> set[str]:
    """The fields whose flags ``argv`` gives, whatever their values.

    ``--plan`` must know which flags the user set, even to their defaults
    (``--batch-size 32`` against a plan of 64 is a conflict): ``argv`` is
    parsed again by a second parser of the same flags built with
    ``argument_default=SUPPRESS``, so only what is given lands in the result.

    Args:
        argv: One command's arguments (after ``train`` or ``simulate``),
            already accepted by that command's own parser.
        config: The command's configuration class.
        concerns: Its concerns (as :func:`add_arguments` takes them).
    """
    p = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    add_arguments(p, config, concerns)
    return set(vars(p.parse_args(list(argv))))


def config_from_args(args: argparse.Namespace, config: type = TrainConfig) -> Any:
    """Build and validate a :class:`TrainConfig` (or ``config``) from parsed arguments.

    With ``--plan FILE`` the plan's settings are applied first
    (:func:`~.config.planned.apply_plan`); the flags given on the command
    line are ``args.given_flags`` (set by ``hybridagg.cli.main`` with
    :func:`given_fields`; without it a field counts as given when it differs
    from its default).

    Raises:
        ValueError: A bad value, naming its flag, or one that conflicts with
            the plan.
    """
    names = {f.name for f in fields(config)}
    values = {k: v for k, v in vars(args).items() if k in names}
    if values.get("plan"):
        from .config.planned import apply_plan

        given = getattr(args, "given_flags", None)
        if given is None:
            defaults = {
                f.name: f.default for f in fields(config) if f.default is not MISSING
            }
            given = {k for k, v in values.items() if defaults.get(k, MISSING) != v}
        values = apply_plan(values, given)
    return config(**values)
