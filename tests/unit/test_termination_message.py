"""The termination message: the trainer writes it (rtj_trainer.termination), the operator reads
it (rtj_wire.termination, rtj_operator.views.pod_view); garbage is ignored with a reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rtj_operator.views import pod_view
from rtj_trainer import termination as writer
from rtj_wire import termination as reader

pytestmark = pytest.mark.unit


def test_a_huge_message_is_shortened_below_kubernetes_limit() -> None:
    message = writer.TerminationMessage(outcome="Failed", reason="ConfigurationError",
                                        message="x" * 10_000, exit_code=94)
    data = message.encode()
    assert len(data) <= writer.MAX_BYTES == 4096
    parsed = json.loads(data)
    assert parsed["message"].endswith("...") and parsed["reason"] == "ConfigurationError"


def test_it_is_written_atomically_where_absent_and_in_place_where_the_kubelet_mounted_it(
    tmp_path: Path,
) -> None:
    fresh = tmp_path / "fresh"
    writer.write(fresh, writer.TerminationMessage(outcome="Succeeded", step=3))
    assert json.loads(fresh.read_text())["step"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["fresh"]  # no tmp file left
    mounted = tmp_path / "mounted"
    mounted.write_text("x" * 5000)  # longer than the message: truncated after the write
    writer.write(mounted, writer.TerminationMessage(outcome="Failed", reason="WorldSizeChanged"))
    assert json.loads(mounted.read_text())["reason"] == "WorldSizeChanged"
    assert writer.is_written(mounted) and not writer.is_written(tmp_path / "missing")


@pytest.mark.parametrize(("text", "problem"), [
    ("Traceback (most recent call last):\n  boom", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"outcome": "Maybe"}', "outcome 'Maybe'"),
    ('{"outcome": "Failed", "step": -1}', "step is -1"),
    ('{"outcome": "Failed", "exitCode": "94"}', "exitCode is '94'"),
    ('{"outcome": "Succeeded", "committedTime": "yesterday"}', "committedTime"),
])
def test_garbage_is_ignored_with_a_reason(text: str, problem: str) -> None:
    outcome, why = reader.parse(text)
    assert outcome is None and why is not None and problem in why


def test_no_message_is_neither_an_outcome_nor_a_problem() -> None:
    assert reader.parse(None) == (None, None)
    assert reader.parse("  \n") == (None, None)


def test_a_bad_reason_word_is_dropped_and_unknown_keys_are_ignored() -> None:
    outcome, _ = reader.parse('{"outcome": "Failed", "reason": "not a word!", "future": 1}')
    assert outcome is not None and outcome.reason == "" and outcome.failed


def pod(message: str | None) -> dict[str, object]:
    terminated: dict[str, object] = {"exitCode": 93, "reason": "Error"}
    if message is not None:
        terminated["message"] = message
    return {
        "metadata": {"name": "tiny-0", "uid": "u", "labels": {
            "training.resilient.dev/role": "trainer",
            "training.resilient.dev/node-index": "0"}},
        "status": {"phase": "Failed", "containerStatuses": [
            {"name": "trainer", "state": {"terminated": terminated}}]},
    }


def test_the_pod_view_carries_the_message_or_why_it_was_ignored() -> None:
    good = pod_view(pod('{"outcome": "Failed", "reason": "DataMismatch", "exitCode": 94}'))
    assert good.outcome is not None and good.outcome.reason == "DataMismatch"
    assert good.outcome_problem is None and good.exit_code == 93
    tail = pod_view(pod("last log line"))
    assert tail.outcome is None and tail.outcome_problem is not None
    assert pod_view(pod(None)).outcome is None
