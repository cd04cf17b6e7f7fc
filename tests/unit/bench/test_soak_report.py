"""The soak's judgement: which outcomes are errors (a stream a replica crash broke is not, if it broke when the
crash happened), and when a constrained answer keeps its schema."""

from __future__ import annotations

from typing import cast

from bench.load_clients import OK, RATE_LIMITED, Answer, Outcome, _judge_structured
from bench.load_crash import BROKEN_WINDOW_S, Crash
from bench.load_platform import SoakPlatform
from bench.load_report import BROKEN_BY_CRASH, UPSTREAM_FAILED, SoakReport


def outcome(kind: str, ended_at: float) -> Outcome:
    return Outcome(kind, latency_s=0.1, on_adapter=True, model="ft:x", ended_at=ended_at)


def report(outcomes: list[Outcome], killed_at: float | None) -> SoakReport:
    crash = None
    if killed_at is not None:
        crash = Crash(cast(SoakPlatform, None), replica=0, after_s=50.0)
        crash.killed_at, crash.restart_s = killed_at, 12.0
    return SoakReport(60.0, 8, [], outcomes, {"api": 1}, {"api": 1}, crash=crash)


def test_streams_broken_when_the_replica_crashed_are_apart_from_errors() -> None:
    broken = outcome(UPSTREAM_FAILED, 100.5)
    late = outcome(UPSTREAM_FAILED, 100.0 + BROKEN_WINDOW_S + 1)  # long after: not the crash's doing
    crashed = report([outcome(OK, 99.0), outcome(RATE_LIMITED, 99.5), broken, late], killed_at=100.0)
    assert crashed.kind(broken) == BROKEN_BY_CRASH
    assert crashed.errors == {UPSTREAM_FAILED: 1} and not crashed.ok

    assert report([outcome(OK, 1.0), broken], killed_at=100.0).ok
    assert not report([outcome(OK, 1.0), broken], killed_at=None).ok  # no crash: a broken stream is an error
    assert not report([outcome("http 500 (internal_error)", 100.5)], killed_at=100.0).ok


def test_data_stores_are_reported_but_not_bounded() -> None:
    grown = report([outcome(OK, 1.0)], killed_at=None)
    grown.stores = {"seaweedfs": (100 << 20, 300 << 20)}
    assert grown.ok and "seaweedfs" in grown.render() and "not bounded" in grown.render()
    grown.rss_end = {"api": 1 << 30}  # the API grew by a GiB: that is a leak
    assert not grown.ok and "GREW PAST THE BOUND" in grown.render()


def test_a_constrained_answer_must_be_complete_json_its_schema_allows() -> None:
    assert _judge_structured(Answer('{"answer": "yes", "sure": true}', "stop")) == OK
    assert _judge_structured(Answer('{"answer": "yes", "sure": tr', "length")) == "structured answer ended by length"
    assert _judge_structured(Answer('{"answer": "perhaps", "sure": true}', "stop")).endswith("breaks its schema")
    assert _judge_structured(Answer('{"answer": "no", "sure": false, "x": 1}', "stop")).endswith("breaks its schema")
    assert _judge_structured(Answer("yes", "stop")) == "structured answer is not JSON"
    assert _judge_structured(Answer("[1]", "stop")).endswith("breaks its schema")
