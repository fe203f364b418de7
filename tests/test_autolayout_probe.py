"""The planner's figures from a measured probe (issue 50): the probe file is read back only on the machine it was
measured on, a damaged one is refused naming it, the probed rates and per-group-size collectives take the place of
the assumptions in the cost model, and, on the figures the benchmark recorded (benchmarks/autolayout_check.py
--record, which rebuilds the file), the estimate orders the layouts as the runs measured them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from distvideo.errors import ConfigError
from distvideo.parallel import planner
from distvideo.models.registry import probe_model
from distvideo.parallel.autolayout import Hardware, ModelFigures, RequestFigures, Shape, estimate, step_time
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
    assert sorted(estimates, key=estimates.get) == sorted(measured, key=measured.get), (estimates, measured)
