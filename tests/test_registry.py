"""The registry of conversion kinds (surgery/kinds): one options model per kind is the source of the command line's
flags, of a recipe's convert fields and of the rules both apply; and the layering of the whole package (LAYERS)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import ClassVar

import pytest
import yaml
from pydantic import ValidationInfo, model_validator

from inprocess import run_cli

from surgery.testing import tiny_models as tm

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "surgery"


# ---- layering: the import graph of the whole package ------------------------------------------------------------
# The package's layers, lowest first: a module may import its own layer and the ones below, never one above. A
# module belongs to the layer of the longest prefix listed here that names it (so a module of a package can sit
# in another layer than its package); and no two of the package's folders and top-level modules import each other
# (test_no_import_circles_between_folders).
# Data flows: checkpoint in -> architecture spec -> kind -> checkpoint out -> check / uptrain -> hub.
# The conversion packages: one per kind (its converter, its kind.py that the registry imports and its options.py, the
# options models that both read); none imports another's modules (test_conversion_packages_never_import_each_other).
CONVERSION_PACKAGES = ("kv", "mla", "swa", "switchhead", "talking_heads", "hybrid")
LAYERS = [
    ("foundation", ["surgery", "surgery.version", "surgery.errors", "surgery.options", "surgery.progress", "surgery.solve",
                    "surgery.units", "surgery.dtypes", "surgery.model_types", "surgery.precision", "surgery.threads",
                    "surgery.logs", "surgery.layer_choice"]),
    ("checkpoint I/O", ["surgery.checkpoint", "surgery.trust", "surgery.data", "surgery.chat",
                        "surgery.retrieval_tasks", "surgery.retrieval_mix", "surgery.runs_in"]),
    ("runtime", ["surgery.runtime"]),
    ("architecture", ["surgery.arch"]),
    ("conversions", ["surgery.calibration", "surgery.fitting", "surgery.fused_qkv", "surgery.estimate",
                     *(f"surgery.{k}" for k in CONVERSION_PACKAGES)]),
    ("kinds", ["surgery.kinds", *(f"surgery.{k}.{m}" for k in CONVERSION_PACKAGES  # each package's kind.py and
                                  for m in ("kind", "options"))]),  # options.py (its converter reads them typed)
    ("checkpoint users", ["surgery.checking", "surgery.inspection", "surgery.bench", "surgery.export",
                          "surgery.dry_run", "surgery.demo", "surgery.publish", "surgery.training",
                          "surgery.memory_estimate"]),
    ("commands", ["surgery.commands"]),
    ("recipes", ["surgery.recipes"]),
    ("Python API", ["surgery.api"]),
    ("command line", ["surgery.clickgen", "surgery.cli"]),
    ("test builders", ["surgery.testing"]),  # for tests and benchmarks: imports anything, imported by nothing here
]


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def _all_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, modules=None) -> set[str]:
    """The surgery modules `path` imports, at module level or inside functions (relative imports resolved; `from
    package import name` is an import of the submodule `package.name` when there is one, else of the package)."""
    modules = modules or _all_modules()
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree)  # `if TYPE_CHECKING:` imports never run
                   if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            names |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    found = set()
    for name in names:
        while name and name not in modules:  # `import surgery.x.y` of a module; a name inside a module: the module
            name = name.rpartition(".")[0]
        if name.startswith("surgery") and name != module:
            found.add(name)
    return found


def _modules() -> dict[str, set[str]]:
    modules = _all_modules()
    return {m: _imports(p, modules) for m, p in modules.items()}


def _layer(module: str) -> int:
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[1]


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop(); on.discard(w); component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(component)
    return out


def upward_imports() -> set[tuple[str, str]]:
    return {(m, n) for m, names in _modules().items() for n in names if _layer(n) > _layer(m)}


def test_every_module_has_a_layer():
    for m in _modules():
        _layer(m)


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    assert sorted(upward_imports()) == []


def test_no_import_circles():
    assert _cycles(_modules()) == []


def folder_imports(modules: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """The import graph between the package's folders and top-level modules (`surgery.kv.aligned.fit` is
    `surgery.kv`); the package itself (`surgery/__init__.py`, its face: version and API) is left out."""
    def unit(m: str) -> str:  # a kind package's kind.py and options.py (surgery/<kind>/{kind,options}.py) belong to
        parts = m.split(".")  # the registry's room
        if len(parts) == 3 and parts[1] in CONVERSION_PACKAGES and parts[2] in ("kind", "options"):
            return "surgery.kinds"
        return ".".join(parts[:2])

    graph: dict[str, set[str]] = {}
    for m, names in (modules if modules is not None else _modules()).items():
        if m == "surgery":
            continue
        graph.setdefault(unit(m), set()).update(unit(n) for n in names if n != "surgery" and unit(n) != unit(m))
    return graph


def test_no_import_circles_between_folders():
    """One way through the package: no folder or top-level module imports one that imports it back, directly or
    round a longer circle (e.g. checkpoint/ -> runtime.py -> checkpoint/)."""
    assert _cycles(folder_imports()) == []


def test_the_folder_graph_sees_a_circle_through_submodules():
    modules = {"surgery.checkpoint.writer": {"surgery.runtime"}, "surgery.runtime": {"surgery.checkpoint.source"},
               "surgery.checkpoint.source": set(), "surgery": {"surgery.cli"}, "surgery.cli": {"surgery"}}
    assert _cycles(folder_imports(modules)) == [{"surgery.checkpoint", "surgery.runtime"}]


def test_the_layering_test_sees_a_circle_and_an_upward_import():
    """The measure itself: a made-up graph with one circle of three and an import up from the foundation."""
    graph = {"surgery.errors": {"surgery.cli"}, "surgery.cli": {"surgery.kinds"}, "surgery.kinds": {"surgery.errors"},
             "surgery.arch": set()}
    assert _cycles(graph) == [{"surgery.errors", "surgery.cli", "surgery.kinds"}]
    assert _layer("surgery.commands.compare_merges") > _layer("surgery.kv.aligned") > _layer("surgery.arch")


def _package_of(module: str) -> str | None:
    """The conversion package a module belongs to (`surgery.kv.aligned.fit`: kv), else None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "surgery" and parts[1] in CONVERSION_PACKAGES else None


def cross_package_imports(modules: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports from one conversion package into another's modules (what they share lives outside all of them:
    surgery.calibration, surgery.fitting, surgery.fused_qkv, surgery.arch, surgery.kinds.base)."""
    return {(m, n) for m, names in modules.items() for n in names
            if _package_of(m) and _package_of(n) and _package_of(n) != _package_of(m)}


def test_conversion_packages_never_import_each_other():
    assert sorted(cross_package_imports(_modules())) == []
    # the measure itself, on a made-up graph: a package's own modules and the shared ones pass, another's do not
    graph = {"surgery.mla.calibrate": {"surgery.mla.refit", "surgery.fitting.refit", "surgery.calibration.capture",
                                       "surgery.kv.aligned.capture"},
             "surgery.swa.kind": {"surgery.kinds.base", "surgery.swa.refusals"},
             "surgery.switchhead.families": {"surgery.kv"}, "surgery.kinds": {"surgery.kv.kind", "surgery.mla.kind"}}
    assert cross_package_imports(graph) == {("surgery.mla.calibrate", "surgery.kv.aligned.capture"),
                                            ("surgery.switchhead.families", "surgery.kv")}


ARCH_ANSWERS = r"""
import json, sys

from surgery import arch
from surgery.kv.refusals import ALIGNED_LABEL, ALIGNED_REFUSES, PLAIN_LABEL, PLAIN_REFUSES
from surgery.mla.refusals import KIND as MLA, REFUSES as MLA_REFUSES
from surgery.swa.refusals import KIND as SWA, REFUSES as SWA_REFUSES
from surgery.switchhead.refusals import KIND as SWITCHHEAD, REFUSES as SWITCHHEAD_REFUSES
from surgery.talking_heads.refusals import KIND as TALKING_HEADS, REFUSES as TALKING_HEADS_REFUSES

TABLES = {PLAIN_LABEL: PLAIN_REFUSES, ALIGNED_LABEL: ALIGNED_REFUSES, MLA: MLA_REFUSES, SWA: SWA_REFUSES,
          SWITCHHEAD: SWITCHHEAD_REFUSES, TALKING_HEADS: TALKING_HEADS_REFUSES}


def answer(call):
    try:
        result = call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return result.name if isinstance(result, arch.ArchSpec) else result


def answers():
    configs = [{"model_type": t} for s in arch.SPECS for t in s.model_types]
    configs += [{"model_type": s.name, **{t.switch: True for t in s.features if t.switch}} for s in arch.SPECS]
    configs += [{"model_type": "roberta"}, {"model_type": "nonesuch"}]
    out = {"any": [answer(lambda: arch.spec_for(c)) for c in configs],
           "label without its table": answer(lambda: arch.spec_for(configs[0], PLAIN_LABEL)),
           "supported": arch.supported_model_types(),
           "converted shape": answer(lambda: arch.attention_shape({
               "model_type": "talking_heads_falcon", "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
               "num_hidden_layers": 2})),
           "table": arch.support_markdown(TABLES, {})}
    for label, table in TABLES.items():
        out[label] = [answer(lambda: arch.spec_for(c, label, table)) for c in configs]
        out[label + " supported"] = arch.supported_model_types(label, table)
    return out


before = answers()
assert "surgery.kinds" not in sys.modules, "the refusal tables' modules imported the registry"
import surgery.kinds

surgery.kinds.kind_names()  # the registry's built-in kinds, loaded
print(json.dumps({"before": before, "after": answers()}))
"""


def test_arch_answers_the_same_before_and_after_the_registry_is_imported():
    """surgery.arch holds no table the registry fills: spec_for, the supported types, the support table and the
    shape of a converted checkpoint read the same in a fresh interpreter before and after `import surgery.kinds`."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", ARCH_ANSWERS], capture_output=True, text=True, cwd=REPO, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    answers = json.loads(run.stdout)
    before, after = answers["before"], answers["after"]
    assert before == after
    # what was compared is real: refusals in the kinds' words, a label without its table refused, a prefix known
    assert before["mqa/gqa mean"][0] == "llama"  # the first family, converted
    assert "talking-heads cannot convert 'falcon': FalconAttention computes attention itself" in str(before)
    assert "swa cannot convert 'bert': encoders need modeling code that travels with the checkpoint" in str(before)
    assert before["label without its table"].startswith("TypeError: ")
    assert before["converted shape"]["kv_heads"] == 1  # falcon's multi_query default, read through its spec


def test_only_the_command_line_imports_surgery_cli():
    offenders = sorted(m for m, names in _modules().items() if m != "surgery.cli" and "surgery.cli" in names)
    assert offenders == []
    assert any(n.startswith("surgery.commands") for n in _modules()["surgery.cli"])


def test_recipes_and_kinds_do_not_import_click():
    """Recipes validate YAML into the options models and call the library: click is the command line's business."""
    for path in [*(PACKAGE / "recipes").glob("*.py"), *(PACKAGE / "kinds").glob("*.py"), *PACKAGE.glob("*/kind.py"),
                 *(PACKAGE / k / "options.py" for k in CONVERSION_PACKAGES if (PACKAGE / k / "options.py").exists()),
                 PACKAGE / "options.py"]:
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "click" not in imported, path


# ---- tests and benchmarks stand on the package, never on a test module ---------------------------------------
# Builders that both use live in `surgery.testing`; the tests' own plumbing (conftest, the CLI runners, the loopback
# hub, ...) lives in tests/ beside the test folders. A test module importing another one, or a benchmark reaching
# into tests/, ties files together that the layout says are apart.
TESTS = REPO / "tests"
BENCHMARKS = REPO / "benchmarks"


def _imported_names(tree: ast.AST) -> set[str]:
    """Every absolute module name a file imports, and `module.name` for each `from module import name`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def _sys_path_edits(tree: ast.AST) -> list[int]:
    """Lines that change sys.path: assignments to it or to a slice of it, and its insert/append/extend."""
    def is_sys_path(n) -> bool:
        n = n.value if isinstance(n, ast.Subscript) else n
        return isinstance(n, ast.Attribute) and n.attr == "path" and getattr(n.value, "id", None) == "sys"

    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) \
            else []
        if any(is_sys_path(t) for t in targets):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value) \
                and node.func.attr in ("insert", "append", "extend"):
            lines.append(node.lineno)
    return lines


def _names_a_test_module(name: str) -> bool:
    return any(part.startswith("test_") for part in name.split("."))


def offenses_of_a_test_module(source: str) -> list[str]:
    """What a module under tests/ may not do: import a test module (`test_x`, `tests.test_x`, `tests.kv.test_x`)."""
    return sorted(n for n in _imported_names(ast.parse(source)) if _names_a_test_module(n))


def benchmark_offenses(source: str) -> list[str]:
    """What a benchmark may not do: import anything of tests/ (a test module, `tests.*`, or one of the tests'
    support modules), or edit sys.path (it imports the installed package; its own folder is on sys.path already)."""
    support = {p.stem for p in TESTS.rglob("*.py")}
    tree = ast.parse(source)
    imports = sorted(n for n in _imported_names(tree)
                     if _names_a_test_module(n) or n.split(".")[0] in support | {"tests"})
    return imports + [f"sys.path edited on line {line}" for line in _sys_path_edits(tree)]


def test_no_test_module_imports_another_test_module():
    offenders = {str(p.relative_to(REPO)): bad for p in sorted(TESTS.rglob("*.py"))
                 if (bad := offenses_of_a_test_module(p.read_text()))}
    assert offenders == {}


def test_benchmarks_import_the_package_and_never_the_tests():
    offenders = {p.name: bad for p in sorted(BENCHMARKS.rglob("*.py")) if (bad := benchmark_offenses(p.read_text()))}
    assert offenders == {}


def test_test_files_have_names_of_their_own():
    """tests/ has no __init__.py: pytest imports each file by its name (rootdir-relative folders are not packages),
    so two test files, or a test file and a support module, must never share one."""
    names = [p.name for p in TESTS.rglob("*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
    assert not list(TESTS.rglob("__init__.py"))


def test_the_import_rules_for_tests_and_benchmarks_see_a_made_up_offense():
    """The measure itself, on sources written here: each way of reaching into tests/ is caught, the allowed ones
    are not."""
    bench = ('import sys\nfrom pathlib import Path\nsys.path[:0] = [str(Path(__file__).parents[1] / "tests")]\n'
             'sys.path.insert(0, "tests")\nfrom test_uptrain import make_model\n'
             'from tests.kv import test_kv_convert\nfrom inprocess import run_cli\n')
    assert benchmark_offenses(bench) == ["inprocess", "inprocess.run_cli", "test_uptrain", "test_uptrain.make_model",
                                         "tests.kv", "tests.kv.test_kv_convert", "sys.path edited on line 3",
                                         "sys.path edited on line 4"]
    assert benchmark_offenses("from surgery.testing import tiny_models\nimport sys\nprint(sys.path)\n") == []
    assert offenses_of_a_test_module("from test_merge_convert import tiny\nimport tests.uptrain.test_uptrain\n") == [
        "test_merge_convert", "test_merge_convert.tiny", "tests.uptrain.test_uptrain"]
    assert offenses_of_a_test_module("from inprocess import run_cli\nfrom surgery.testing.aligned import aligned\n") == []


# ---- one rule, two spellings -----------------------------------------------------------------------------------
RULES = [
    ({"to": "gqa"}, "--to gqa needs --kv-heads N", "to: gqa needs kv_heads"),
    ({"to": "gqa", "kv_heads": 0}, "--kv-heads must be at least 1, got 0", "kv_heads must be at least 1, got 0"),
    ({"to": "mqa", "kv_heads": 2}, "--to mqa means one K/V head; use --to gqa --kv-heads N for more",
     "to: mqa means one K/V head; use to: gqa with kv_heads for more"),
    ({"to": "switchhead", "heads": 2}, "--to switchhead needs --heads H --experts E --topk K",
     "to: switchhead needs heads, experts and topk"),
    ({"to": "switchhead", "heads": 2, "experts": 2, "topk": 1, "calib_tokens": 0},
     "--calib-tokens must be positive, got 0", "calib_tokens must be positive, got 0"),
    ({"to": "mqa", "merge": "aligned", "calib_window": 1},
     "--calib-window must be at least 2, got 1", "calib_window must be at least 2, got 1"),
    ({"to": "mla", "kv_rank": 8, "calib_chunk": 0},
     "--calib-chunk must be at least 1 window, got 0", "calib_chunk must be at least 1 window, got 0"),
]


def _flags(values: dict) -> list[str]:
    return [a for k, v in values.items() for a in ("--" + k.replace("_", "-"), str(v))]


@pytest.mark.parametrize("values, cli_message, recipe_message", RULES)
def test_a_rule_is_written_once_and_said_in_each_frontend_s_words(values, cli_message, recipe_message, tmp_path,
                                                                  capsys):
    """The same validator refuses the command line's options and the recipe's fields, each in its own spelling."""
    from surgery.errors import SurgeryError
    from surgery.recipes import load_recipe

    code, _, err = run_cli(capsys, "convert", tmp_path / "missing", *_flags(values), "--out", tmp_path / "o")
    assert code == 2 and err.strip().splitlines() == [f"surgery: error: {cli_message}"]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"source": {"path": "src"}, "output": "run", "steps": [{"convert": values}]}))
    with pytest.raises(SurgeryError) as e:
        load_recipe(path)
    assert str(e.value).endswith(f"steps[0].convert: {recipe_message}"), str(e.value)


# ---- a kind added at test time -------------------------------------------------------------------------------
@pytest.fixture
def demo_kind():
    """A kind with one option of its own (`--frobnicate`, required by its rule); registered for the test only."""
    from surgery.kinds import Kind, WriteOptions, register, unregister
    from surgery.options import option, spelling

    class DemoOptions(WriteOptions):
        GROUP: ClassVar[str] = "demo"
        frobnicate: int | None = option(None, "--frobnicate", "[demo] How hard to frobnicate.", metavar="F",
                                        group=GROUP)

        @model_validator(mode="after")
        def _needed(self, info: ValidationInfo):
            if self.frobnicate is None:
                s = spelling(info, type(self))
                raise ValueError(f"{s.kind('demo')} needs {s.options(['frobnicate'])}")
            return self

    class Demo(Kind):
        seen: list = []

        def convert(self, source, out, options):
            self.seen.append(options)
            out.mkdir()
            (out / "options.json").write_text(options.model_dump_json())
            return {"seconds": 0.0}

    kind = register(Demo("demo", DemoOptions))
    try:
        yield kind
    finally:
        unregister("demo")


def test_a_kind_added_at_test_time_gets_its_flags_its_recipe_fields_and_its_rule(demo_kind, tmp_path, capsys,
                                                                                  monkeypatch):
    import surgery.cli as cli
    from surgery.errors import SurgeryError
    from surgery.recipes import load_recipe
    from surgery.recipes.schema import step_models

    command = cli.convert_command()
    flags = {o for p in command.params for o in p.opts}
    assert "--frobnicate" in flags and "demo" in next(p for p in command.params if p.name == "to").type.choices
    assert "frobnicate" in step_models()["convert"].model_fields
    monkeypatch.setitem(cli.cli.commands, "convert", command)

    code, out, err = run_cli(capsys, "convert", "--help")
    assert code == 0 and "--frobnicate F" in out and "[demo] How hard to frobnicate." in out

    src = tmp_path / "src"
    tm.make_tiny("llama", src)
    code, out, err = run_cli(capsys, "convert", src, "--to", "demo", "--out", tmp_path / "o")
    assert code == 2 and err.strip() == "surgery: error: --to demo needs --frobnicate F"
    code, out, err = run_cli(capsys, "convert", src, "--to", "demo", "--frobnicate", "7", "--seed", "3",
                             "--out", tmp_path / "o")
    assert code == 0, err
    written = json.loads((tmp_path / "o" / "options.json").read_text())
    assert written["frobnicate"] == 7 and written["seed"] == 3 and written["force"] is False
    assert type(demo_kind.seen[-1]).__name__ == "DemoOptions" and demo_kind.seen[-1].frobnicate == 7

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"source": {"path": str(src)}, "output": str(tmp_path / "run"),
                                      "steps": [{"convert": {"to": "demo", "frobnicate": 5}}]}))
    step = load_recipe(recipe).validated_steps()[0]
    assert step.options.kind is demo_kind and step.options.kind_options.frobnicate == 5
    recipe.write_text(yaml.safe_dump({"source": {"path": str(src)}, "output": str(tmp_path / "run"),
                                      "steps": [{"convert": {"to": "demo"}}]}))
    with pytest.raises(SurgeryError, match=r"steps\[0\]\.convert: to: demo needs frobnicate$"):
        load_recipe(recipe)
    recipe.write_text(yaml.safe_dump({"source": {"path": str(src)}, "output": str(tmp_path / "run"),
                                      "steps": [{"convert": {"to": "demo", "frobnicate": 4}}]}))
    code, out, err = run_cli(capsys, "run", recipe)
    assert code == 0, err
    assert "$ surgery convert" in out and "--to demo --frobnicate 4" in out
    assert demo_kind.seen[-1].frobnicate == 4 and demo_kind.seen[-1].force  # the runner owns --force


# ---- options back into flags --------------------------------------------------------------------------------
@pytest.mark.parametrize("values", [
    {"to": "gqa", "kv_heads": 2, "merge": "aligned", "grouping": "consecutive", "calib_tokens": 512, "dtype": "bfloat16"},
    {"to": "talking-heads", "logits_mixing": False, "heads_logits": 8, "chunk_size": 0, "allow_pickle": True},
    {"to": "switchhead", "heads": 4, "experts": 2, "topk": 1, "device": "cpu", "max_shard_size": "30KB"},
])
def test_a_recipe_step_s_command_line_parses_back_into_the_same_options(values):
    """The flags a recipe step shows (and an accelerate launch runs) are the command line's own flags."""
    import click

    import surgery.cli as cli
    from surgery.clickgen import parse_options
    from surgery.commands.convert import options_model
    from surgery.options import command_args
    from surgery.recipes.schema import step_models

    step = step_models()["convert"].model_validate(values)
    args = command_args(step, exclude=("name",))
    command = cli.cli.commands["convert"]
    ctx = command.make_context("convert", ["src", *args], parent=click.Context(cli.cli, info_name="surgery"))
    with ctx:  # the options the flags gave, as the command itself parses them
        parsed = parse_options(options_model(), {k: v for k, v in ctx.params.items() if k not in ("source",)})
    assert parsed.kind_options == step.kind_options
    assert parsed.kind_options.model_fields_set == step.kind_options.model_fields_set


def test_uptrain_s_options_are_declared_once_and_worded_per_front_end():
    """The library's run options are the command's options model (its flags, a recipe's fields, its rules) plus what
    only a library call gives: a rule reads --seq-len in the library and seq_len in a recipe."""
    from surgery.commands.uptrain import UptrainArgs
    from surgery.errors import SurgeryError
    from surgery.options import YAML
    from surgery.training import UptrainOptions

    assert issubclass(UptrainOptions, UptrainArgs)
    assert set(UptrainOptions.model_fields) - set(UptrainArgs.model_fields) == {"model", "out", "progress"}
    with pytest.raises(SurgeryError, match=r"^--seq-len must be at least 2 "):
        UptrainOptions(model="m", out="o", tokens=64, seq_len=1)
    with pytest.raises(ValueError, match=r"seq_len must be at least 2 ") as refused:
        UptrainArgs.model_validate({"tokens": 64, "seq_len": 1}, context={"spelling": YAML})
    assert "--" not in str(refused.value)


@pytest.mark.parametrize("args, message", [
    (("convert", "x"), "Missing option '--to'."),
    (("uptrain", "x", "--out", "y"), "Missing option '--tokens'."),
    (("push", "x"), "Missing argument 'REPO_ID'."),
])
def test_a_required_field_is_a_required_option(args, message, capsys, tmp_path, monkeypatch):
    """A field without a default is one the command line asks for, in click's words, before anything runs."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and err.startswith(f"surgery: error: {message}") and list(tmp_path.iterdir()) == []


def test_merge_method_names_are_the_pooling_methods_and_aligned():
    """The command line's, a recipe's and compare-merges' merge methods (kv/options.py) are the library's pooling
    methods (kv/pool.py) plus the aligned merge: one list, the other its subset."""
    from surgery.kv.options import METHODS
    from surgery.kv.pool import POOL_METHODS

    assert METHODS == (*POOL_METHODS, "aligned")
