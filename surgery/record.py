"""The header every conversion's surgery.json starts with: toolkit, version, kind, time and the source."""

from __future__ import annotations

import time
from pathlib import Path

from . import __version__


def conversion_record(kind: str, source, config: dict, shard_hashes: dict[str, str]) -> dict:
    """`source`: the resolved `surgery.source.Source`; `shard_hashes`: {file name: sha256} of its weight files."""
    return {
        "toolkit": "surgery",
        "version": __version__,
        "kind": kind,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": {
            "spec": source.spec,
            "folder": str(Path(source.folder).absolute()),
            "revision": source.revision,
            "gguf_file": source.gguf_file,
            "model_type": config.get("model_type"),
            "shards_sha256": shard_hashes,
        },
    }
