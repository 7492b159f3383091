"""The target's linear layers alone, per kernel and row count: what a forward's matmuls cost with each kernel the
fast backend can pick here, without the rest of the forward (decode/linear_kernels.py `measure`: stand-in weights
of the model's shapes, more of them than the last-level cache holds, scaled back to the model's layer count).

    .venv/bin/python scripts/linears.py [--target smollm2-135m-instruct] [--kernels nativepack nativehw onednn4]
                                        [--rows 1 2 3 4 5 6 8] [--repeats 9]

Prints ms per forward's linears and the GB/s at which they read the weights (bytes of the fp32 weights over the time).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from specdraft.decode.linear_kernels import KERNELS, candidates, measure, weight_bytes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--kernels", nargs="+", choices=sorted(KERNELS), help="default: every candidate here")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 8])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    from specdraft.decode.fast_target import linear_shapes
    from specdraft.io.hardware import cpu_model
    from specdraft.io.target import load_target

    model = load_target(args.target, "float32").model
    shapes = linear_shapes(model)
    names = args.kernels or candidates(torch.float32, model.device)
    unavailable = {n: KERNELS[n].available(torch.float32, model.device) for n in names}
    names = [n for n in names if unavailable[n] is None]
    for name, reason in unavailable.items():
        if reason:
            print(f"{name}: not here ({reason})")
    times = measure(shapes, torch.float32, names, rows=tuple(args.rows), repeats=args.repeats)
    gigabytes = weight_bytes(shapes, torch.float32) / 1e9
    print(f"{args.target}: {gigabytes:.3f} GB of linear weights, {cpu_model()}, {torch.get_num_threads()} threads; "
          f"ms (GB/s) by rows {args.rows}")
    for name in names:
        cells = "  ".join(f"{times[name][str(r)]:6.2f} ({gigabytes / times[name][str(r)] * 1000:4.1f})" for r in args.rows)
        print(f"  {name:<11} {cells}")


if __name__ == "__main__":
    main()
