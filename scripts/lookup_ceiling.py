"""The ceiling of prompt lookup on a benchmark's own outputs (decode/ceiling.py): what an oracle scheduler
could have gained with the lookup's drafts, priced on the run's measured verify curve and on a flat one.

    .venv/bin/python scripts/lookup_ceiling.py RUN [--max-draft N]

RUN is a `decode/bench.py` output folder (results.json, samples.jsonl) of a greedy run (T=0: its outputs are
the target's own, whichever proposer ran). The lookup is configured as the run's proposer.max_ngram and
min_ngram (3 and 1 where the run had another proposer); --max-draft defaults to the run's decode.num_draft (longer
drafts than the run's profile priced get τ and the flat-curve ceiling only).
Prints the table and writes RUN/ceiling.json. Compare the ceilings with the run's speedup_vs_plain.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)

import argparse  # noqa: E402
import json  # noqa: E402

from specdraft.decode.ceiling import ceiling, every_occurrence, lookup_drafts  # noqa: E402
from specdraft.decode.profile import CostProfile  # noqa: E402
from specdraft.io.files import write_text_atomically  # noqa: E402


def load_run(run: Path) -> tuple[dict, list[tuple[list[int], list[int]]]]:
    results, samples = run / "results.json", run / "samples.jsonl"
    for path in (results, samples):
        if not path.is_file():
            raise SystemExit(f"{path} is missing: RUN must be a decode/bench.py output folder (bench.mode=single)")
    summary = json.loads(results.read_text())
    if summary["config"]["decode"]["temperature"] != 0:
        raise SystemExit(f"{run} ran at T={summary['config']['decode']['temperature']}: the ceiling needs a greedy "
                         "run (decode.temperature=0), whose outputs are the target's own")
    rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    return summary, [(row["prompt_token_ids"], row["output_token_ids"]) for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--max-draft", type=int, default=None)
    args = parser.parse_args()
    summary, samples = load_run(args.run)
    config = summary["config"]
    lookup = config["proposer"] if config["proposer"]["name"] == "ngram" else {"max_ngram": 3, "min_ngram": 1}
    profile = CostProfile(**json.loads(Path(summary["profile"]["path"]).read_text()))
    measured = len(profile.verify["single"]["1"])  # verify lengths the profile measured (1 .. num_draft + 1)
    max_draft = args.max_draft or config["decode"]["num_draft"]
    price = (lambda tokens: profile.verify_s(1, tokens)) if max_draft < measured else None  # noqa: E731
    result = {"run": str(args.run), "max_draft": max_draft, "lookup": {k: lookup[k] for k in ("max_ngram", "min_ngram")},
              "verify_ms": [round(1000 * s, 2) for s in profile.verify["single"]["1"]],
              "run_speedup_vs_plain": summary.get("speedup_vs_plain"), "run_tau": summary.get("tau"),
              "lookup_oracle": ceiling(samples, lookup_drafts(lookup["max_ngram"], lookup["min_ngram"]), price, max_draft),
              "every_occurrence_oracle": ceiling(samples, every_occurrence, price, max_draft)}
    print(f"{len(samples)} outputs, verify ms by tokens {result['verify_ms']}, drafts up to {max_draft} tokens "
          f"(the profile prices verifies of up to {measured})")
    print(f"  the run:                      tau {result['run_tau']:.3f}  speedup vs plain {result['run_speedup_vs_plain']:.3f}")
    for name in ("lookup_oracle", "every_occurrence_oracle"):
        bound = result[name]
        on_curve = bound["speedup_measured_curve"]
        on_curve = "unpriced" if on_curve is None else f"{on_curve:.3f}"
        print(f"  {name:<28}  tau {bound['tau']:.3f}  ceiling on the measured curve {on_curve}"
              f"  on a flat curve {bound['speedup_flat_curve']:.3f}")
    write_text_atomically(args.run / "ceiling.json", json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.run / 'ceiling.json'}")


if __name__ == "__main__":
    main()
