"""Rebuild the demo's shipped pipeline (models/demo/tiny-flux-v3), or check that a rebuild is the shipped files.

    python tools/build_demo_pipeline.py           # pre-train (~200 s on a core), replace models/demo/, write its key
    python tools/build_demo_pipeline.py --check   # pre-train into a temporary folder, compare byte for byte

Run it after editing what builds the pipeline (models/pretrain.py, models/tiny_text.py, models/flux.py: their
hash is the key, models.build_inputs_key); tests/test_pretrain.py fails until the shipped key is current again.
"""
from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models  # noqa: E402
from models import pretrain  # noqa: E402


def different_files(a: str, b: str) -> list[str]:
    """Relative paths present in only one of two folders, or whose bytes differ."""
    def files(root):
        return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}
    ours, theirs = files(a), files(b)
    return sorted((ours ^ theirs) | {f for f in ours & theirs
                                     if not filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="flux", choices=models.SHIPPED)
    parser.add_argument("--check", action="store_true", help="rebuild aside and compare; change nothing")
    args = parser.parse_args()
    family = models.get_family(args.model)
    target = os.path.join(models.SHIPPED_DIR, f"tiny-{args.model}-v3")
    with tempfile.TemporaryDirectory() as tmp:
        built = os.path.join(tmp, "pipeline")
        family.build_tiny(built, seed=0, pretrain_config=pretrain.variant_config(family, "full"))
        if args.check:
            differ = different_files(built, target)
            print(f"{target}: " + ("the rebuild is identical" if not differ else f"differs in {', '.join(differ)}"))
            return 1 if differ else 0
        aside = f"{target}.old"
        if os.path.isdir(target):
            os.replace(target, aside)
        shutil.copytree(built, target)
        shutil.rmtree(aside, ignore_errors=True)
    with open(f"{target}.key.tmp", "w") as f:
        f.write(models.build_inputs_key(args.model) + "\n")
    os.replace(f"{target}.key.tmp", f"{target}.key")
    print(f"wrote {target} and its key")
    return 0


if __name__ == "__main__":
    sys.exit(main())
