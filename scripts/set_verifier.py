"""Point a drafter export's speculators config.json at the target a serving engine verifies with.

    python scripts/set_verifier.py RUN/export /models/SmolLM2-135M-Instruct

vLLM and llama.cpp's converter read `speculators_config.verifier.name_or_path`; a distill run writes the target's
Hugging Face id there (the embedded alias's id, or the folder or id it was given). Use this where your server loads
the target from elsewhere. A folder is written as an absolute path.
"""

from __future__ import annotations

import argparse

from specdraft.models.export import set_serving_verifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", help="the export folder of a distill run (RUN/export)")
    parser.add_argument("target", help="the target as the server resolves it: a folder or a Hugging Face id")
    args = parser.parse_args()
    previous = set_serving_verifier(args.export, args.target)
    print(f"{args.export}/config.json: verifier {previous!r} -> {args.target!r}")


if __name__ == "__main__":
    main()
