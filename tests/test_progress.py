"""Long first loads say what they are doing (progress.py); quick ones print nothing."""

import re
import threading
import time

import pytest

from mlxnb.models import progress


def test_slow_load_shows_its_stages_and_quick_load_is_silent(capsys, monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.2)
    monkeypatch.setattr(progress, "_tty", lambda: True)  # a terminal
    with progress.loading("quick"):
        progress.stage("warming up")
    assert capsys.readouterr().err == ""

    def worker():  # stages are reported from the engine's worker thread
        progress.stage("converting")
        time.sleep(1.2)
        progress.stage("warming up")
        time.sleep(1.2)

    with progress.loading("slow"):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    err = capsys.readouterr().err
    assert "mlxnb: loading slow" in err
    assert "converting" in err and "warming up" in err
    assert "00:01" in err  # the clock moved while one stage ran
    assert progress._bar is None
    progress.stage("after")  # outside a load: nothing, no error
    assert capsys.readouterr().err == ""


def test_progress_can_be_turned_off(capsys, monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setenv("MLXNB_PROGRESS", "0")
    with progress.loading("x"):
        progress.stage("warming up")
        time.sleep(0.6)
    assert capsys.readouterr().err == ""


def test_in_a_notebook_the_line_is_one_output_updated_in_place(monkeypatch):
    """A kernel gets a text output updated by display id, ending as "loaded ..." (a
    tqdm widget bar would read "model not found" in a saved notebook)."""
    import IPython.display as ipd

    shown = []
    monkeypatch.setattr(progress, "DELAY_S", 0.2)
    monkeypatch.setattr(progress, "_in_kernel", lambda: True)
    monkeypatch.setattr(ipd, "display", lambda data, raw, display_id:
                        shown.append(("display", display_id, data["text/plain"])))
    monkeypatch.setattr(ipd, "update_display", lambda data, raw, display_id:
                        shown.append(("update", display_id, data["text/plain"])))
    with progress.loading("m"):
        progress.stage("warming up")
        end = time.monotonic() + 20  # until the clock's second tick is shown
        while not any("[00:01], warming up" in t for _, _, t in shown):
            assert time.monotonic() < end, shown
            time.sleep(0.05)
    assert shown[0][0] == "display" and all(k == "update" for k, _, _ in shown[1:])
    assert len({i for _, i, _ in shown}) == 1
    assert any("mlxnb: loading m [00:01], warming up" in t for _, _, t in shown), shown
    assert re.fullmatch(r"mlxnb: loaded m in \d+\.\d+ s \(reading weights, warming up\)",
                        shown[-1][2]), shown[-1]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError])
def test_a_load_that_fails_or_is_interrupted_never_says_loaded(monkeypatch, exc):
    import IPython.display as ipd

    shown = []
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "_in_kernel", lambda: True)
    monkeypatch.setattr(ipd, "display", lambda data, raw, display_id:
                        shown.append(data["text/plain"]))
    monkeypatch.setattr(ipd, "update_display", lambda data, raw, display_id:
                        shown.append(data["text/plain"]))
    with pytest.raises(exc):
        with progress.loading("m"):
            end = time.monotonic() + 20
            while not shown:  # the line is up
                assert time.monotonic() < end
                time.sleep(0.02)
            raise exc("no such model")
    assert re.fullmatch(r"mlxnb: stopped loading m in \d+\.\d+ s \(.*\)", shown[-1]), shown


def test_no_redraws_into_a_file_or_pipe(capsys, monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "_tty", lambda: False)
    with progress.loading("x"):
        progress.stage("warming up")
        time.sleep(0.6)
    assert capsys.readouterr().err == ""
