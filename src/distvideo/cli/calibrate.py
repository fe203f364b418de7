"""`distvideo calibrate --model M [--steps N]`: run the model once without skipping and store MagCache's magnitude
ratios for its scheduler and that step count beside the model (models/cache_ratios.py), where `--cache mag` finds
them."""

from __future__ import annotations

import argparse
from typing import Any

from distvideo.cli.arguments import add_engine_arguments, cli_naming, engine_config_from_args
from distvideo.errors import ConfigError

CALIBRATION_PROMPT = "a red fox running through fresh snow in a forest, cinematic light"


def add_calibrate_parser(sub: Any) -> None:
    cal = sub.add_parser("calibrate", help="store MagCache's ratios for the model and a step count (--cache mag)")
    add_engine_arguments(cal)
    cal.add_argument(
        "--steps", dest="num_inference_steps", type=int, default=None, help="step count (default: the model's)"
    )
    cal.add_argument("--prompt", default=CALIBRATION_PROMPT, help="the prompt of the calibration run")
    cal.add_argument("--seed", type=int, default=0, help="noise seed of the calibration run")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from distvideo.executors import resolve_engine
    from distvideo.generator import VideoGenerator
    from distvideo.models.cache_ratios import RATIOS_FILE, write_ratios
    from distvideo.models.embedded import packaged_model
    from distvideo.paths import check_output_target
    from distvideo.request import CACHE_CALIBRATE, GenerationRequest

    engine_config, _ = engine_config_from_args(args)
    engine = resolve_engine(engine_config)
    if packaged_model(engine.model.path):
        raise ConfigError(
            f"--model {engine.model.path}: a model shipped inside the distvideo package; its {RATIOS_FILE} is part "
            f"of the package and is not rewritten. Calibrate a copy instead: cp -r {engine.model.path} "
            f"~/models/{engine.model.path.name} && distvideo calibrate --model ~/models/{engine.model.path.name}"
        )
    given = GenerationRequest(
        prompt=args.prompt,
        seed=args.seed,
        num_inference_steps=args.num_inference_steps,
        cache=CACHE_CALIBRATE,
        save_video=False,
        return_frames=False,
        naming=cli_naming(args),
    )
    request = engine.model.resolve_request(given)  # bad input (the step count) before loading
    if engine.launch is None:  # the model folder takes the ratios file: refused before loading when it cannot
        check_output_target(engine.model.path / RATIOS_FILE, name="calibrate: the model folder's ratios file")
    with VideoGenerator.from_engine(engine) as gen:
        result = gen.generate_request(request)
    if result.cache is None or "ratios" not in result.cache:
        return 1  # a rank that holds no output
    schedule = engine.model.schedule(request).key()  # the checkpoint's (or its distvideo_defaults.json's)
    path = write_ratios(engine.model.path, schedule, request.num_inference_steps, result.cache["ratios"])
    print(path, flush=True)
    return 0
