"""Write an lm-eval task made of held-out pydoc text, for `surgery check --tasks` without any download.

LAMBADA's format on pydoc: every paragraph of at least 20 words that ends in a word and a full stop, from pydoc's
first documents (those `surgery check` evaluates on by default and no calibration reads: calibrations read pydoc
from its last document backwards), becomes one item: the paragraph up to its last word is the context, " word" the
target. Metrics: accuracy (the target is the model's greedy continuation) and the target's perplexity.

    python benchmarks/pydoc_cloze_task.py OUT_DIR [--documents 22]
    surgery check SOURCE CONVERTED --tasks OUT_DIR/pydoc_cloze.yaml --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from surgery.data import pydoc_texts

LAST_WORD = re.compile(r"^(?P<context>.+) (?P<word>[A-Za-z]{2,})\.$")
YAML = """task: pydoc_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{' ' + word}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
metadata:
  version: 1.0
  source: "pydoc_data.topics, documents 0..{last} (paragraphs of >= 20 words ending in a word and a full stop)"
"""


def items(documents: int) -> list[dict]:
    out = []
    for doc in pydoc_texts()[:documents]:
        for paragraph in doc.split("\n\n"):
            text = " ".join(paragraph.split())
            m = LAST_WORD.match(text)
            if m and len(text.split()) >= 20:
                out.append({"context": m["context"], "word": m["word"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--documents", type=int, default=22, help="pydoc's first N documents (default: 22, the "
                        "documents of `surgery check`'s default 16,384 tokens)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "pydoc_cloze.jsonl"
    rows = items(args.documents)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (args.out / "pydoc_cloze.yaml").write_text(YAML.format(data=data.resolve(), last=args.documents - 1))
    print(f"{len(rows)} items from pydoc's first {args.documents} documents -> {args.out / 'pydoc_cloze.yaml'}")


if __name__ == "__main__":
    main()
