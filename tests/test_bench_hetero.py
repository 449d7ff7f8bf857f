"""The headline driver's pure parts: level specs and the per-cell summary."""

import importlib.util
from pathlib import Path

import pytest

HETERO = Path(__file__).resolve().parents[1] / "bench" / "hetero.py"


@pytest.fixture(scope="module")
def hetero():
    spec = importlib.util.spec_from_file_location("bench_hetero", HETERO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(mode, level, seed, ttt, sps=1000.0):
    return {
        "mode": mode,
        "level": level,
        "seed": seed,
        "time_to_target_s": ttt,
        "samples_per_sec": sps,
        "efficiency": 0.5,
        "final_accuracy": 0.95,
        "mean_staleness": 0.0,
    }


def test_level_specs(hetero):
    assert hetero.level_spec("8", 3.0) == "0-1:1,2-3:8"
    assert hetero.level_spec("change", 2.5) == "0-1:1,2-3:4@0;0-1:4,2-3:1@2.5"


def test_cells_give_medians_ranges_and_the_cut_against_sync(hetero):
    records = [record("sync", "8", s, t) for s, t in enumerate([6.0, 8.0, 7.0])]
    records += [record("fast-pair", "8", s, t) for s, t in enumerate([1.0, 2.0, None])]
    rows = {c["mode"]: c for c in hetero.cells(records)}
    assert rows["sync"]["ttt"] == (7.0, 6.0, 8.0)
    assert rows["sync"]["cut_vs_sync"] == pytest.approx(0.0)
    # a seed that never reached the target is left out of the median, and said
    assert rows["fast-pair"]["ttt"] == (1.5, 1.0, 2.0)
    assert rows["fast-pair"]["reached"] == 2 and rows["fast-pair"]["runs"] == 3
    assert rows["fast-pair"]["cut_vs_sync"] == pytest.approx(1 - 1.5 / 7.0)
    table = hetero.markdown(hetero.cells(records), 0.9)
    assert "| 8x | fast-pair | 1.50 [1.00-2.00] (2/3 reached) | 79% |" in table


def test_every_mode_is_known_and_fast_pair_runs_on_two_ranks(hetero):
    assert hetero.MODES["fast-pair"][0] == 2
    assert {"sync", "hybrid", "async", "ddp", "horovod"} <= set(hetero.MODES)
    with pytest.raises(SystemExit, match="unknown --modes"):
        hetero.main(["--modes", "sync,warp"])
