"""The planner's figures from a measured probe (issue 50): the probe file is read back only on the machine it was
measured on, a damaged one is refused naming it, the probed rates and per-group-size collectives take the place of
the assumptions in the cost model, and, on the figures the benchmark recorded (benchmarks/autolayout_check.py
--record, which rebuilds the file), the estimate orders the layouts as the runs measured them."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

from distvideo.cli.main import main
from distvideo.errors import ConfigError
from distvideo.models.registry import probe_model
from distvideo.parallel import planner
from distvideo.parallel import probe as probe_module
from distvideo.parallel.autolayout import NEAR, Hardware, ModelFigures, RequestFigures, Shape, estimate, step_time
from distvideo.parallel.probe import PROBE_VERSION, ProbeFigures, cached_probe, probe_machine

RECORD = Path(__file__).resolve().parent.parent / "benchmarks" / "records" / "autolayout_check.json"
MODES = {"single": (1, Shape(1, 1, 1, 1)), "cfg2": (2, Shape(1, 2, 1, 1))}
MODES |= {"ulysses2": (2, Shape(1, 1, 2, 1)), "ring2": (2, Shape(1, 1, 1, 2))}


def figures(**machine) -> ProbeFigures:
    return ProbeFigures(
        flops={1: 40e9, 2: 70e9},
        layer_overhead={1: 2e-4, 2: 3e-4},
        collectives={2: (7e-4, 2e9)},
        machine=machine or probe_machine(),
        measured="2026-12-07T00:00:00Z",
    )


@pytest.fixture
def probe_file(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "probe.json"
    monkeypatch.setenv("DISTVIDEO_PROBE_FILE", str(path))
    return path


def test_the_probe_file_is_read_back_on_its_own_machine_only(probe_file):
    assert cached_probe() is None  # none yet: the assumptions
    probe_file.write_text(json.dumps(figures().to_json()))
    assert cached_probe() == figures()
    probe_file.write_text(json.dumps(figures(host="elsewhere", cpu="", cores=1, torch="0").to_json()))
    assert cached_probe() is None
    probe_file.write_text(json.dumps({**figures().to_json(), "version": PROBE_VERSION + 1}))
    assert cached_probe() is None


@pytest.mark.parametrize("text", ["{", '{"flops": {}}', json.dumps({**figures().to_json(), "flops": {"1": -1}})])
def test_a_damaged_probe_file_is_refused_naming_it(probe_file, text):
    probe_file.write_text(text)
    with pytest.raises(ConfigError, match=str(probe_file)):
        cached_probe()


def test_probed_figures_replace_the_assumptions(probe_file, tiny_model):
    assumed = planner.device_figures("cpu", 2)
    assert assumed.source == "assumed" and assumed.collectives == ()
    probe_file.write_text(json.dumps(figures().to_json()))
    probed = planner.device_figures("cpu", 2)
    assert probed == planner.cpu_figures(2, None, figures())
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert probed.source == "probed" and (probed.flops, probed.layer_overhead) == figures().for_threads(threads)
    # an all-to-all of 2 ranks costs the measured latency and bandwidth, not the assumed ones: the Ulysses term
    info = probe_model(tiny_model)
    model, request = planner.model_figures(info, 4), planner.request_figures(info, planner.default_request(info), 4)
    moved = 4 * -(-request.tokens // 2) * model.hidden * model.dtype_bytes / 2
    forwards = 2 if request.guided else 1
    ulysses = step_time(model, request, probed, 2, Shape(1, 1, 2, 1))["ulysses"]
    assert ulysses == pytest.approx(forwards * model.layers * (2 * 7e-4 + moved / 2e9))


def test_the_probed_estimate_orders_the_layouts_as_measured():
    """On the recorded run's inputs (the probe's figures as the planner turned them into each layout's Hardware, the
    checkpoint's and request's figures), today's cost model ranks the layouts as their measured medians do."""
    record = json.loads(RECORD.read_text())
    model = ModelFigures(**record["model_figures"])
    request = RequestFigures(**record["request_figures"])
    measured = record["median_s"]
    estimates = {}
    for mode, (world, shape) in MODES.items():
        fields = record["hardware"][mode]
        hardware = Hardware(**{**fields, "collectives": tuple(tuple(c) for c in fields["collectives"])})
        assert hardware.source == "probed"
        estimates[mode] = estimate(model, request, hardware, world, shape).time
    # every pair the runs tell apart (medians more than the planner's tie band apart) is ordered alike
    apart = [(a, b) for a in MODES for b in MODES if measured[a] < measured[b] * (1 - NEAR)]
    assert apart, measured
    for faster, slower in apart:
        assert estimates[faster] < estimates[slower], (faster, slower, estimates, measured)
    # and each estimate is within 25% of its median, as docs/parallel.md says
    assert all(abs(estimates[m] - measured[m]) <= 0.25 * measured[m] for m in MODES), (estimates, measured)


def test_plan_probe_measures_keeps_and_plans_with_the_figures(probe_file, capsys, monkeypatch):
    """One real probe (layers timed on this machine, two spawned gloo ranks; fewer rounds than a user's, for time),
    then the plan names its figures; a probe for a CUDA plan is refused before anything is measured."""
    monkeypatch.setattr(probe_module, "measure", functools.partial(probe_module.measure, rounds=2, repeats=2))
    assert main(["plan", "--num-gpus", "2", "--device", "cpu", "--probe", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    probe = cached_probe()
    assert probe is not None and probe.machine == probe_machine() and set(probe.collectives) == {2}
    assert all(x > 0 for x in [*probe.flops.values(), *probe.layer_overhead.values(), *probe.collectives[2]])
    assert plan["hardware"]["source"] == "probed" and plan["hardware"]["collectives"][0][:2] == [
        2,
        probe.collectives[2][0],
    ]
    assert main(["plan", "--num-gpus", "2"]) == 0 and "by --probe" in capsys.readouterr().out
    probe_file.unlink()
    assert main(["plan", "--num-gpus", "2", "--device", "cuda", "--probe"]) == 2
    assert "--probe with --device cuda" in capsys.readouterr().err and not probe_file.exists()
