"""The judgement of tools/user_battery.py (issue 15's new-user battery): its classifier, not onnxgen."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import user_battery as ub  # noqa: E402


def _case(error=None, success=None) -> ub.Case:
    return ub.Case(9, "t", "test", lambda c: ub.Run(), error, success, "none", 10, False)


TRACE = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: boom\n'


@pytest.mark.parametrize(
    "run, error, success, lost, want",
    [
        (ub.Run(rc=2, stderr="onnxgen: error: seed 18446744073709551616 is out of range"), ("seed",), None, [], "ok"),
        (
            ub.Run(rc=2, stderr="usage: onnxgen\nonnxgen generate: error: argument --seed: bad"),
            ("seed",),
            None,
            [],
            "ok",
        ),
        (ub.Run(rc=2, stderr="onnxgen: error: something failed"), ("seed",), None, [], "unclear"),
        (ub.Run(rc=1, stderr="onnxgen: error: seed too big"), ("seed",), None, [], "unclear"),
        (ub.Run(rc=2, stderr="killed"), ("seed",), None, [], "unclear"),
        (ub.Run(rc=1, stderr=TRACE), ("seed",), None, [], "traceback"),
        (
            ub.Run(rc=0, stderr="Exception ignored in: <_io.TextIOWrapper>\nBrokenPipeError"),
            None,
            ub.exit0,
            [],
            "traceback",
        ),
        (ub.Run(rc=0, stdout="text"), ("seed",), None, [], "wrong result"),
        (ub.Run(rc=0, stdout="RESULT wrong aliased"), None, ub.api_ok, [], "wrong result"),
        (ub.Run(rc=0, stdout="RESULT ok"), None, ub.api_ok, [], "ok"),
        (ub.Run(rc=2, stderr="onnxgen: error: no chat template"), None, ub.exit0, [], "refused"),
        (ub.Run(rc=0), None, ub.exit0, ["out/notes.txt is gone"], "data loss"),
        (ub.Run(rc=1, stderr=TRACE), None, ub.exit0, ["out/notes.txt is gone"], "traceback"),
        (ub.Run(rc=None, timed_out=True, stderr=TRACE), None, ub.exit0, [], "hang"),
        (ub.Run(rc=2, stderr="onnxgen: error: prompt too long", chat_kept=False), None, ub.exit0, [], "lost chat"),
        (ub.Run(rc=-9), ("x",), None, [], "unclear"),
        (
            ub.Run(rc=2, stderr="pip says:\n" + TRACE + "onnxgen: error: pip download failed (disk full)"),
            ("disk",),
            None,
            [],
            "ok",
        ),
    ],
)
def test_classify(run, error, success, lost, want):
    assert ub.classify(_case(error, success), run, None, lost)[0] == want


def test_postconditions_rank_by_severity():
    run = ub.Run(rc=0)
    run.problem("resource", "slow")
    run.problem("wrong result", "left .building-x behind")
    assert ub.classify(_case(success=ub.exit0), run, None, []) == ("wrong result", "left .building-x behind")


def test_first_message_prefers_the_error_line_and_the_exception():
    assert ub.first_message(ub.Run(rc=2, stderr="progress\nonnxgen: error: bad seed\n")) == "bad seed"
    assert ub.first_message(ub.Run(rc=1, stderr=TRACE)) == "ValueError: boom"
    assert ub.first_message(ub.Run(rc=0, stdout="> \n Paris.\n")) == "Paris."


def test_every_issue_item_has_cases_and_ids_are_unique():
    ids = [c.id for c in ub.CASES]
    assert len(ids) == len(set(ids))
    assert {c.item for c in ub.CASES} == set(range(1, 19))
    assert 100 <= len(ids) <= 160


def test_api_harness_reports_like_the_cli(capsys):
    body = (
        "    result(False, 'aliased')\n    result(True)\n    from onnxgen.errors import ModelLoadError\n"
        "    raise ModelLoadError('bad model')\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        exec(compile(ub.API_HARNESS.format(pkg="", body=body), "snippet.py", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr()
    assert exit_info.value.code == 2
    assert out.out.splitlines() == ["RESULT wrong aliased", "RESULT ok"]
    assert ub.error_message(ub.Run(rc=2, stderr=out.err)) == "bad model"
