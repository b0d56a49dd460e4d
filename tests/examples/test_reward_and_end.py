"""examples/openclaw/set_reward.py and end_session.py: resolution, bodies, messages."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

KEY = "sk-sess-" + "c" * 43


@pytest.fixture
def sr(load_example: Callable[[str], ModuleType]) -> ModuleType:
    return load_example("set_reward")


@pytest.fixture
def es(load_example: Callable[[str], ModuleType]) -> ModuleType:
    return load_example("end_session")


def test_reward_defaults_to_one_and_reads_reward_from_the_environment(sr: ModuleType) -> None:
    assert sr.parse_options([], {}).reward == 1.0
    assert sr.parse_options([], {"REWARD": "-0.5"}).reward == -0.5
    assert sr.parse_options(["--reward", "0.25"], {"REWARD": "-0.5"}).reward == 0.25


@pytest.mark.parametrize("raw", ["abc", "nan", "inf", "1,5"])
def test_a_reward_that_is_not_a_finite_number_is_refused(sr: ModuleType, raw: str) -> None:
    with pytest.raises(ValueError, match="number"):
        sr.parse_reward(raw)


def test_a_bad_reward_flag_is_a_usage_error(
    sr: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        sr.parse_options(["--reward", "high"], {})
    assert exited.value.code == 2
    assert "the reward must be a number, got 'high'" in capsys.readouterr().err


def test_session_key_comes_from_the_flag_then_session_api_key(sr: ModuleType) -> None:
    assert sr.parse_options(["--api-key", KEY], {"SESSION_API_KEY": "other"}).api_key == KEY
    assert sr.parse_options([], {"SESSION_API_KEY": KEY}).api_key == KEY
    assert sr.parse_options([], {}).api_key is None


def test_reward_body_names_the_interaction_only_when_given(sr: ModuleType) -> None:
    assert sr.request_body(1.0, None) == {"reward": 1.0}
    assert sr.request_body(0.0, "chatcmpl-1") == {"reward": 0.0, "interaction_id": "chatcmpl-1"}


def test_reward_failure_message_has_the_status_and_the_gateways_message(sr: ModuleType) -> None:
    body = {"error": {"message": "no interaction yet", "type": "invalid_request", "code": "x"}}
    assert sr.failure_message((400, body, {})) == (
        "set_reward failed (HTTP 400): no interaction yet"
    )


def test_set_reward_without_a_key_exits_1_with_a_hint(
    sr: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        sr.main([], {})
    assert exited.value.code == 1
    out = capsys.readouterr().out
    assert "no session key given" in out
    assert "SESSION_API_KEY" in out


def test_end_session_answer_is_parsed(es: ModuleType) -> None:
    payload = {
        "message": "success",
        "session_id": "demo-task-1",
        "trajectory_id": "traj-1",
        "interaction_count": 3,
    }
    ended = es.parse_ended(payload)
    assert (ended.session_id, ended.trajectory_id, ended.interaction_count) == (
        "demo-task-1",
        "traj-1",
        3,
    )


def test_an_empty_episode_has_no_trajectory_id(es: ModuleType) -> None:
    ended = es.parse_ended({"message": "success", "trajectory_id": None, "interaction_count": 0})
    assert ended.trajectory_id == ""
    assert ended.interaction_count == 0


@pytest.mark.parametrize(
    "payload", ["text", {"interaction_count": "3"}, {"interaction_count": True}]
)
def test_an_answer_that_is_not_an_end_session_reply_is_refused(
    es: ModuleType, payload: object
) -> None:
    assert es.parse_ended(payload) is None


def test_end_session_output_says_what_was_published(
    es: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    es.print_ended(es.Ended(session_id="demo-task-1", trajectory_id="traj-9", interaction_count=2))
    out = capsys.readouterr().out
    assert "published" in out
    assert "  → Trajectory ID     : traj-9" in out
    assert "  → Interaction count : 2" in out
    es.print_ended(es.Ended(session_id="demo-task-2", trajectory_id="", interaction_count=0))
    assert "nothing was published" in capsys.readouterr().out


def test_end_session_without_a_key_exits_1(
    es: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        es.main([], {})
    assert exited.value.code == 1
    assert "no session key given" in capsys.readouterr().out
