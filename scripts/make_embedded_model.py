#!/usr/bin/env python
"""Regenerate the embedded tiny Wan model shipped in src/distvideo/assets/tiny-wan.

Deletes the folder and rebuilds it with random weights from fixed seeds (see distvideo.testing.checkpoints); running it twice
gives byte-identical files. Prints every file's size and sha256 and the total size.

    python scripts/make_embedded_model.py [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

# Nothing is downloaded: the builder only constructs components locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Always the repository's own package, so the shipped copy under src/ is the one regenerated (not an installed one).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from distvideo.models.embedded import TINY_MODEL_DIR
from distvideo.testing.checkpoints import build_embedded_model

SIZE_LIMIT = 1_000_000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TINY_MODEL_DIR, help=f"output folder (default {TINY_MODEL_DIR})")
    args = parser.parse_args(argv)

    out = build_embedded_model(args.out)
    total = 0
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        data = path.read_bytes()
        total += len(data)
        print(f"{len(data):>9}  {hashlib.sha256(data).hexdigest()}  {path.relative_to(out)}")
    print(f"{total:>9}  total bytes in {out}")
    if total >= SIZE_LIMIT:
        print(f"error: the embedded model must stay under {SIZE_LIMIT} bytes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
