"""The export tests' shared files: the tiny pydoc Llama, its swa and MLA outputs, and each one's f32 GGUF file
(`from exported_files import exported` makes the fixture a test module's own: it is built once per module)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """kind -> (checkpoint folder, its f32 GGUF file): the tiny Llama, its swa output (window 8, layer 1 global),
    the same with sinks (granite_swa) set to values that act, as uptraining leaves them, and its MLA output (rank 32,
    rope 8)."""
    import torch
    from safetensors.torch import load_file, save_file

    from surgery.checkpoint.source import resolve_source
    from surgery.commands.export import export_checkpoint
    from surgery.mla import convert_to_mla
    from surgery.mla.options import MLAOptions
    from surgery.swa.convert import convert_to_swa
    from surgery.swa.options import SWAOptions

    from surgery.testing.pydoc_llama import make_model, make_tokenizer

    root = tmp_path_factory.mktemp("export")
    tiny = make_model(root / "tiny", make_tokenizer())
    folders = {"llama": tiny}
    folders["swa"] = root / "swa"
    convert_to_swa(resolve_source(str(tiny)), folders["swa"], SWAOptions(window=8, global_layers="1"), progress=False)
    folders["sinks"] = root / "sinks"
    convert_to_swa(resolve_source(str(tiny)), folders["sinks"], SWAOptions(window=8, global_layers="1", sinks=True),
                   progress=False)
    weights = load_file(folders["sinks"] / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith("self_attn.sinks")]:  # trained-like: about the keys' logits
        weights[name] = torch.randn(weights[name].shape, generator=g) + 1.0
    save_file(weights, folders["sinks"] / "model.safetensors", metadata={"format": "pt"})
    folders["mla"] = root / "mla"
    convert_to_mla(resolve_source(str(tiny)), folders["mla"],
                   MLAOptions(kv_rank=32, rope_dim=8, calib=["pydoc"], calib_tokens=512), progress=False)
    files = {}
    for kind, folder in folders.items():
        files[kind] = root / f"{kind}.gguf"
        export_checkpoint(str(folder), files[kind])
    return {kind: (folders[kind], files[kind]) for kind in folders}
