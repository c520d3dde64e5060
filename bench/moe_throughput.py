"""MoE engine throughput: decode tokens/s of pdserve's engine against transformers `generate`
on one tiny random MoE model (Qwen3-MoE by default), batch 16, in one run.

Lifecycle: build the model with transformers' own config into a temporary folder
(pdcore.testing.tiny_models, seeded), then run bench/engine_throughput.py's measurement on it
(alternating order, both greedy, exactly --new-tokens per sequence, token agreement checked);
results go to bench/results/moe_throughput_<arch>.json and .png.

Run: `python bench/moe_throughput.py [--arch qwen3_moe|qwen2_moe|mixtral] [--quick]
[--hidden 128] [--layers 4]` (other flags pass through to engine_throughput.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "qwen2_moe", "mixtral"])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    args, rest = ap.parse_known_args(argv)

    import engine_throughput

    from pdcore.testing.tiny_models import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        path = make_tiny_model(str(Path(tmp) / args.arch), arch=args.arch, vocab_size=2048,
                               hidden=args.hidden, layers=args.layers, seed=0)
        # results under their own name, not over the dense bench's
        engine_throughput.NAME = f"moe_throughput_{args.arch}"
        return engine_throughput.main(["--model-path", path, "--batch-sizes", "16",
                                       "--no-bf16", *rest])


if __name__ == "__main__":
    main()
