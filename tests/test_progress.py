"""One progress implementation (surgery/progress.py, on tqdm) for checks and uptraining: plain lines when the output
is not a terminal, a tqdm bar when it is, nothing outside the main process."""

import io

import tqdm

from surgery.progress import Progress, format_rate
from surgery.training.progress import Progress as UptrainProgress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_when_piped_and_a_tqdm_bar_on_a_terminal(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    piped = io.StringIO()
    with Progress(100, "check source", every=0, stream=piped) as p:
        p.update(25)
        p.write("a message")
        p.update(75)
    lines = piped.getvalue().splitlines()
    assert lines[0].startswith("check source: 25/100 tokens (25%), ") and "tokens/s, ETA " in lines[0]
    assert lines[1] == "a message" and lines[2].startswith("check source: 100/100 tokens (100%)")
    term = Terminal()
    with Progress(100, "check source", every=0, stream=term) as p:
        assert isinstance(p.bar, tqdm.tqdm)
        p.update(40)
        p.bar.refresh()
    assert "check source:  40%|" in term.getvalue()


def test_uptrain_progress_is_the_same_implementation(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert issubclass(UptrainProgress, Progress)
    out = io.StringIO()
    p = UptrainProgress(4, 1, 512, enabled=True, every_s=0, stream=out, terminal=False, data_line=lambda: "read 9 tokens")
    for step in (2, 3, 4):
        p.step({"step": step, "loss": 2.5, "tokens_per_s": 100.0})
    lines = out.getvalue().splitlines()
    assert [ln.split(",")[0] for ln in lines] == ["uptrain: step 2/4", "uptrain: step 3/4", "uptrain: step 4/4"]
    assert lines[-1].startswith("uptrain: step 4/4, 2,048/2,048 tokens, ") and lines[-1].endswith(
        "loss 2.5000; read 9 tokens")


def test_only_the_main_process_reports(monkeypatch):
    out = io.StringIO()
    monkeypatch.setenv("RANK", "1")
    with Progress(10, "check source", every=0, stream=out) as p:
        p.update(10)
        p.write("hidden")
    assert out.getvalue() == ""
    monkeypatch.setenv("RANK", "0")
    with Progress(10, "check source", every=0, stream=out) as p:
        p.update(10)
    assert out.getvalue().startswith("check source: 10/10 tokens (100%)")


def test_layer_and_teacher_progress_are_the_same_implementation(monkeypatch, capsys):
    """Calibration's per-layer progress and `surgery teacher`'s window count are surgery.progress.Progress: a line per
    layer when stderr is not a terminal (with the caller's note), a tqdm bar on a terminal, nothing outside rank 0."""
    import inspect

    from surgery.calibration.stream import LayerProgress
    from surgery.training import teacher_pass

    assert issubclass(LayerProgress, Progress) and "Progress(total" in inspect.getsource(teacher_pass.teacher_pass)
    monkeypatch.delenv("RANK", raising=False)
    with LayerProgress("calibrate + merge", 2) as bar:
        bar.update()
        bar.update(" (query refit 0.01)")
    lines = capsys.readouterr().err.splitlines()
    assert [l.split(" (")[0] for l in lines] == ["calibrate + merge: layer 1/2", "calibrate + merge: layer 2/2"]
    assert lines[1].endswith(" s) (query refit 0.01)")
    monkeypatch.setattr("sys.stderr", Terminal())
    with LayerProgress("calibrate", 3) as bar:
        assert isinstance(bar.bar, tqdm.tqdm)
    monkeypatch.setenv("RANK", "1")
    with LayerProgress("calibrate", 3) as bar:
        bar.update()
        assert bar.bar is None and not bar.plain


def test_slow_units_show_seconds_each_and_the_eta_counts_what_is_left(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    p = Progress(30, "score layers", unit="layer", enabled=False)
    p.start -= 100.0  # 100 s ago
    p.done = 4  # 25 s each: the rate rounds to 0 layer/s, which said nothing
    line = p.line(now=p.start + 100.0)
    assert line == "score layers: 4/30 layer (13%), 25s each, ETA 10m50s"
    assert format_rate(812.4, "tokens") == "812 tokens/s" and format_rate(2.54, "layer") == "2.5 layer/s"
    assert format_rate(0.0, "layer") == "- layer/s"
    steps = UptrainProgress(16, 0, 2048, enabled=False)  # uptraining's line, hours formatted as every other's
    steps.start -= 4000.0
    steps.done, steps.loss = 4, 1.25
    assert steps.line(now=steps.start + 4000.0) == (
        "uptrain: step 4/16, 8,192/32,768 tokens, 2.0 tokens/s, ETA 3h20m, loss 1.2500")
