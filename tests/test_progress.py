"""Long first loads say what they are doing (progress.py); quick ones print nothing."""

import threading
import time

from mlxnb import progress


def test_slow_load_shows_its_stages_and_quick_load_is_silent(capsys, monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.2)
    with progress.loading("quick"):
        progress.stage("warming up")
    assert capsys.readouterr().err == ""

    def worker():  # stages are reported from the engine's worker thread
        progress.stage("converting")
        time.sleep(0.8)
        progress.stage("warming up")
        time.sleep(0.7)

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
