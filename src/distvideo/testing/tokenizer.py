"""The tiny checkpoints' tokenizer: a T5-style Unigram tokenizer trained, deterministically, on a corpus embedded here.

Used by :mod:`distvideo.testing.checkpoints`; not needed at run time (a checkpoint carries its tokenizer files).
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["build_tiny_tokenizer", "save_tokenizer"]

_PAD, _EOS, _UNK = "<pad>", "</s>", "<unk>"

# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer corpus: a few hundred short English sentences about scenes, animals and motion.

_HANDWRITTEN = """\
A cat walks slowly across a sunny kitchen floor.
A golden retriever runs along the beach at sunset, splashing through the waves.
Two horses gallop across a green meadow under a cloudy sky.
A red fox jumps over a fallen log in a snowy forest.
The camera pans left to reveal a quiet mountain lake at dawn.
A flock of birds flies over the city skyline in the evening.
A small boat drifts down a calm river surrounded by tall trees.
Rain falls on a busy street while people hurry past with umbrellas.
A panda eats bamboo while sitting in the shade of a tree.
The waves crash against rugged rocks, sending white foam into the air.
A dancer spins gracefully on a wooden stage under a bright spotlight.
An astronaut floats inside a space station, waving at the camera.
A hummingbird hovers near a bright purple flower in the garden.
Snow slowly covers a small village at night, lights glowing in the windows.
A train moves through the countryside past fields of yellow flowers.
A close-up shot of a dog's nose sniffing the grass.
Fireworks explode over the harbor, reflected in the dark water.
A child rides a bicycle down a quiet street lined with trees.
The camera zooms in on a steaming cup of coffee on a wooden table.
A turtle swims slowly through clear blue water above a coral reef.
Clouds move quickly across the sky in a time-lapse over the desert.
A chef chops vegetables quickly on a cutting board.
An eagle soars high above a deep canyon, its wings spread wide.
Leaves fall gently from the trees in an autumn park.
A robot walks through a futuristic city at night, neon signs glowing.
Two kittens play with a ball of yarn on a soft carpet.
A waterfall pours into a misty pool surrounded by ferns.
A man in a blue jacket walks his dog through a snowy park.
A jellyfish glows as it drifts through the dark ocean.
The sun rises over the hills, and the fog slowly lifts from the valley.
Bright tones, overexposed, static, blurred details, subtitles, worst quality, low quality.
Ugly, incomplete, extra fingers, poorly drawn hands, deformed, messy background, walking backwards.
"""

_SUBJECTS = [
    "a cat",
    "a dog",
    "a horse",
    "a rabbit",
    "a bird",
    "a fox",
    "a bear",
    "a deer",
    "a tiger",
    "a penguin",
    "an elephant",
    "a wolf",
    "a squirrel",
    "a dolphin",
    "a frog",
    "an owl",
    "a little girl",
    "an old man",
    "a woman in a red dress",
    "a group of children",
    "a giraffe",
    "a lion",
    "a monkey",
    "a duck",
    "a swan",
    "a butterfly",
    "a goat",
    "a sheep",
    "a cow",
    "a young boy",
    "a skateboarder",
    "a cyclist",
    "a kangaroo",
    "a zebra",
    "a parrot",
    "a whale",
    "a crab",
    "an octopus",
    "a hedgehog",
    "a camel",
]
_ADJECTIVES = [
    "small",
    "large",
    "fluffy",
    "brown",
    "white",
    "black",
    "golden",
    "spotted",
    "striped",
    "curious",
    "happy",
    "sleepy",
    "playful",
    "tiny",
    "graceful",
    "wild",
    "young",
    "old",
    "colorful",
    "shy",
]
_ACTIONS = [
    "runs",
    "walks",
    "jumps",
    "swims",
    "flies",
    "dances",
    "rolls",
    "climbs",
    "sleeps",
    "turns around",
    "looks at the camera",
    "moves slowly",
    "spins in circles",
    "plays",
    "waits quietly",
    "chases a ball",
    "eats an apple",
    "drinks water",
    "sits still",
    "stretches",
    "hides behind a rock",
    "crawls forward",
    "glides",
    "leaps",
    "wanders",
]
_PLACES = [
    "in a forest",
    "on a sandy beach",
    "across a snowy field",
    "through a busy market",
    "near a small river",
    "on a mountain path",
    "in a quiet garden",
    "under a bright moon",
    "along a city street",
    "inside a cozy room",
    "beside a lake",
    "in the rain",
    "over the ocean",
    "in a field of flowers",
    "at the edge of a cliff",
    "in a jungle",
    "on a frozen pond",
    "through tall grass",
    "around a campfire",
    "on a rooftop",
    "in a library",
    "under a waterfall",
    "across a desert",
    "inside a cave",
    "on a farm",
]
_STYLES = [
    "The camera follows smoothly.",
    "Cinematic lighting, high detail.",
    "Slow motion, soft focus.",
    "Wide angle shot at golden hour.",
    "Handheld camera, natural colors.",
    "Aerial view, gentle movement.",
    "Close-up, shallow depth of field.",
    "Time-lapse, vivid colors.",
    "Black and white, film grain.",
    "Bright morning light, calm mood.",
    "Dramatic shadows, moody atmosphere.",
    "Tracking shot, sharp focus.",
    "Pastel palette, dreamy look.",
    "Overcast sky, muted tones.",
    "Night scene, warm lamps.",
]
# Every character the tokenizer should know appears in the data, so its score comes from training (characters only
# listed in a trainer's initial alphabet get scores that depend on hash order).
_ALPHABET_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789",
    string.punctuation,
]


def _corpus() -> Iterator[str]:
    yield from _HANDWRITTEN.splitlines()
    yield from _ALPHABET_LINES
    # Deterministic combinations: 400 sentences, each list cycling at its own stride.
    for i in range(400):
        subject = _SUBJECTS[i % len(_SUBJECTS)]
        noun = subject.split(" ", 1)[1]
        adjective = _ADJECTIVES[(3 * i + i // len(_SUBJECTS)) % len(_ADJECTIVES)]
        article = "an" if adjective[0] in "aeiou" else "a"
        action = _ACTIONS[(7 * i + i // len(_SUBJECTS)) % len(_ACTIONS)]
        place = _PLACES[(11 * i + 3) % len(_PLACES)]
        style = _STYLES[(13 * i + i // 7) % len(_STYLES)]
        who = f"{article} {adjective} {noun}" if i % 3 else subject
        sentence = f"{who} {action} {place} in frame {i % 10 + 1}." if i % 17 == 0 else f"{who} {action} {place}."
        yield f"{sentence[0].upper()}{sentence[1:]} {style}"


def build_tiny_tokenizer(vocab_size: int = 512) -> Any:
    """Train a T5-style Unigram tokenizer on the embedded corpus; returns a ``tokenizers.Tokenizer``.

    ``<pad>`` is id 0, ``</s>`` (eos) id 1 and ``<unk>`` id 2; a post-processor appends ``</s>``. The pre-tokenizer and
    decoder are the ones ``transformers.T5Tokenizer`` (v5) rebuilds from a ``tokenizer.json``, and there is no
    normalizer, so the file behaves the same whether a loader uses it verbatim (transformers 4 ``T5TokenizerFast``) or
    only takes its vocabulary (transformers 5).

    The Unigram trainer picks a stable set of pieces, but their scores carry ~1e-13 noise from hash-map iteration
    order and ties come out in varying order, so the vocabulary is canonicalised: scores rounded to 8 decimals, pieces
    sorted by (score descending, text).
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors, trainers
    from tokenizers.models import Unigram

    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    trained = Tokenizer(Unigram())
    trained.pre_tokenizer = pre_tokenizer
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=[_PAD, _EOS, _UNK], unk_token=_UNK, show_progress=False
    )
    trained.train_from_iterator(_corpus(), trainer=trainer)

    specials = [_PAD, _EOS, _UNK]
    pieces = json.loads(trained.to_str())["model"]["vocab"]
    rest = sorted(((round(score, 8), piece) for piece, score in pieces if piece not in specials), key=_piece_order)
    vocab = [(piece, 0.0) for piece in specials] + [(piece, score) for score, piece in rest]
    missing = sorted(set(string.ascii_letters + string.digits + string.punctuation) - {p for p, _ in vocab})
    if missing:
        raise RuntimeError(f"tokenizer training left out characters {missing}")

    tokenizer = Tokenizer(Unigram(vocab, unk_id=2, byte_fallback=False))
    tokenizer.add_special_tokens(specials)
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=["$A", _EOS], pair=["$A", _EOS, "$B", _EOS], special_tokens=[(_EOS, 1)]
    )
    return tokenizer


def _piece_order(item: tuple[float, str]) -> tuple[float, str]:
    return -item[0], item[1]


def save_tokenizer(tokenizer: Any, out_dir: Path, model_max_length: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "T5Tokenizer",
        "eos_token": _EOS,
        "pad_token": _PAD,
        "unk_token": _UNK,
        "extra_ids": 0,
        "additional_special_tokens": [],
        "model_max_length": model_max_length,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
