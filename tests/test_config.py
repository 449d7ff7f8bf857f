"""The environment-variable registry (pure logic, no MPI)."""

import re
from pathlib import Path

import pytest

from hybridagg.runtime import envvars

PACKAGE = Path(__file__).resolve().parent.parent / "hybridagg"


def test_every_variable_is_documented():
    for name, var in envvars.ENV_VARS.items():
        assert name == var.name
        assert len(var.doc) > 10, name


def test_no_module_but_envvars_reads_the_environment():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "envvars.py":
            continue
        text = path.read_text()
        if re.search(r"os\.environ\[|os\.environ\.get|os\.getenv|putenv", text):
            offenders.append(str(path))
    assert offenders == []


def test_every_name_used_in_the_package_is_declared():
    used = set()
    for path in PACKAGE.rglob("*.py"):
        used |= set(re.findall(r"envvars\.get_\w+\(\s*\"(\w+)\"", path.read_text()))
        used |= set(re.findall(r"envvars\.export\(\s*\"(\w+)\"", path.read_text()))
    assert used, "the scan found no uses at all"
    assert used <= set(envvars.ENV_VARS), used - set(envvars.ENV_VARS)


def test_typed_getters(monkeypatch):
    monkeypatch.setenv("HYBRIDAGG_TIMEOUT", "12.5")
    assert envvars.get_float("HYBRIDAGG_TIMEOUT") == 12.5
    monkeypatch.delenv("HYBRIDAGG_TIMEOUT")
    assert envvars.get_float("HYBRIDAGG_TIMEOUT") == 600.0
    monkeypatch.setenv("HYBRIDAGG_NUM_THREADS", "3")
    assert envvars.get_int("HYBRIDAGG_NUM_THREADS") == 3
    monkeypatch.setenv("HYBRIDAGG_ABORT_ON_ERROR", "off")
    assert envvars.get_bool("HYBRIDAGG_ABORT_ON_ERROR") is False


@pytest.mark.parametrize(
    "name,value,getter",
    [
        ("HYBRIDAGG_TIMEOUT", "soon", envvars.get_float),
        ("HYBRIDAGG_NUM_THREADS", "two", envvars.get_int),
        ("HYBRIDAGG_ABORT_ON_ERROR", "maybe", envvars.get_bool),
    ],
)
def test_bad_values_name_the_variable(monkeypatch, name, value, getter):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        getter(name)


def test_undeclared_name_is_refused():
    with pytest.raises(KeyError, match="not declared"):
        envvars.get_str("HYBRIDAGG_NO_SUCH_THING")
    with pytest.raises(KeyError, match="not declared"):
        envvars.export("HYBRIDAGG_NO_SUCH_THING", "1")


def test_describe_lists_every_variable():
    table = envvars.describe()
    for name in envvars.ENV_VARS:
        assert f"`{name}`" in table
