"""Long commands show a bar on a terminal and nothing in a log."""

from __future__ import annotations

from diloco.progress import Progress


def test_a_bar_on_a_terminal_shows_the_postfix_and_keeps_lines_above_it(capsys):
    bar = Progress(100, "island0", percent=True, enabled=True)
    bar.set(40, round="2/5", loss="2.345")
    bar.write("[island0] round 2/5 ok")
    bar.close()
    out, err = capsys.readouterr()
    assert out == "[island0] round 2/5 ok\n"
    assert "40%" in err and "round=2/5" in err and "loss=2.345" in err


def test_nothing_but_the_lines_when_the_output_is_not_a_terminal(capsys):
    bar = Progress(100, "island0", percent=True)  # pytest's stderr is not a terminal
    bar.set(40, loss="2.345")
    bar.write("[island0] round 2/5 ok")
    bar.close()
    out, err = capsys.readouterr()
    assert out == "[island0] round 2/5 ok\n" and err == ""
