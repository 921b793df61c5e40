"""A recipe built in Python and run with `surgery.run_recipe`: convert to MQA, check, and see the second run skip
the finished steps.

    python examples/recipe_from_python.py                     # SmolLM2-135M, embedded (no download)
    python examples/recipe_from_python.py --model DIR --fast  # a local checkpoint folder, small budgets
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a checkpoint folder, or smollm2 (default)")
    parser.add_argument("--out", type=Path, help="the recipe's output folder (default: a temporary folder)")
    parser.add_argument("--fast", action="store_true", help="small token budgets (tiny models, tests)")
    args = parser.parse_args(argv)

    import surgery

    tokens, seq_len = (256, 64) if args.fast else (4096, 512)
    source = {"id": "smollm2"} if args.model == "smollm2" else {"path": str(args.model)}
    recipe = {
        "source": source,
        "output": str(args.out or Path(tempfile.mkdtemp(prefix="surgery-recipe-"))),
        "steps": [
            {"convert": {"to": "mqa", "merge": "aligned", "calib": "pydoc", "calib_tokens": 2 * tokens,
                         "calib_window": seq_len}},
            {"check": {"data": "pydoc", "tokens": tokens, "seq_len": seq_len}},
        ],
    }
    runs = []
    for attempt in ("first run", "second run"):
        result = surgery.run_recipe(recipe)
        print(f"{attempt}: " + ", ".join(f"{name} {how}" for name, how in result.steps))
        runs.append(result)
    report = json.loads((result.output / "02-check.json").read_text())
    print(f"check: KL {report['kl']:.4f}, top-1 agreement {report['top1_agreement']:.1%}; outputs in {result.output}")
    return runs


if __name__ == "__main__":
    main()
