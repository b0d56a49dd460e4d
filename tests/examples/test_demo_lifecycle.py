"""examples/openclaw/demo_lifecycle.py: options, the chat body, parsing answers, the summary."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

KEY = "sk-sess-" + "d" * 43


@pytest.fixture
def demo(load_example: Callable[[str], ModuleType]) -> ModuleType:
    return load_example("demo_lifecycle")


def test_defaults_run_two_episodes_with_reward_one_and_a_discovered_model(
    demo: ModuleType,
) -> None:
    options = demo.parse_options([], {})
    assert options.episodes == 2
    assert options.reward == 1.0
    assert options.model is None
    assert options.prompt == "Solve step by step: What is 12 * 15 + 3?"
    assert options.end is False
    assert options.gateway_url == "http://127.0.0.1:8080"


def test_arealstyle_environment_is_read(demo: ModuleType) -> None:
    env = {
        "ADMIN_KEY": "adm",
        "TASK_ID": "t",
        "REWARD": "0.5",
        "MODEL": "m1",
        "PROMPT": "hi",
    }
    options = demo.parse_options(["--episodes", "3", "--end"], env)
    assert (options.admin_key, options.task_id, options.reward, options.model, options.prompt) == (
        "adm",
        "t",
        0.5,
        "m1",
        "hi",
    )
    assert options.episodes == 3 and options.end is True


def test_zero_episodes_is_a_usage_error(demo: ModuleType) -> None:
    with pytest.raises(SystemExit) as exited:
        demo.parse_options(["--episodes", "0"], {})
    assert exited.value.code == 2


def test_chat_body_is_areals_demo_request(demo: ModuleType) -> None:
    body = demo.chat_body("rollgate-mock", "What is 2+2?")
    assert body == {
        "model": "rollgate-mock",
        "messages": [
            {
                "role": "system",
                "content": "You are a helpful math tutor. Show your work step by step.",
            },
            {"role": "user", "content": "What is 2+2?"},
        ],
        "temperature": 0.7,
        "max_tokens": 512,
    }


def test_first_model_id_takes_the_first_usable_entry(demo: ModuleType) -> None:
    listing = {"object": "list", "data": [{"id": ""}, {"id": "rollgate-mock"}, {"id": "b"}]}
    assert demo.first_model_id(listing) == "rollgate-mock"
    assert demo.first_model_id({"data": []}) is None
    assert demo.first_model_id("Unauthorized") is None


def test_assistant_text_reads_strings_and_content_parts(demo: ModuleType) -> None:
    plain = {"choices": [{"message": {"role": "assistant", "content": "183"}}]}
    parts = {"choices": [{"message": {"content": [{"type": "text", "text": "1"}, {"text": "83"}]}}]}
    assert demo.assistant_text(plain) == "183"
    assert demo.assistant_text(parts) == "183"
    assert demo.assistant_text({"choices": [{"message": {"content": None}}]}) == ""
    assert demo.assistant_text({"choices": []}) == ""


def test_long_answers_are_shortened_with_a_marker(demo: ModuleType) -> None:
    assert demo.shorten("abc", 5) == "abc"
    assert demo.shorten("abcdefgh", 5) == "abcde … [3 more characters]"


def test_refresh_retry_wait_follows_retry_after_within_bounds(demo: ModuleType) -> None:
    assert demo.retry_wait_s({"retry-after": "3"}) == 3.0
    assert demo.retry_wait_s({"retry-after": "0"}) == 1.0
    assert demo.retry_wait_s({"retry-after": "3600"}) == 30.0
    assert demo.retry_wait_s({}) == 5.0


def test_summary_lists_the_shared_key_and_each_episode(demo: ModuleType) -> None:
    results = [
        demo.EpisodeResult(index=1, session_id="demo-task-1", completion_id="c1", reward=1.0),
        demo.EpisodeResult(index=2, session_id="demo-task-2", completion_id="c2", reward=1.0),
    ]
    assert demo.summary_lines(KEY, results) == [
        f"API Key: {KEY[:12]}... (reused across all episodes)",
        "Episode 1: session_id=demo-task-1, completion_id=c1, reward=1.0",
        "Episode 2: session_id=demo-task-2, completion_id=c2, reward=1.0",
    ]


def test_last_episode_note_says_how_it_gets_published(demo: ModuleType) -> None:
    note = demo.last_episode_note("http://gw:1", KEY)
    assert "published on the next refresh" in note[0]
    assert f"start_session.py http://gw:1 --api-key {KEY}" in note[1]
    assert f"end_session.py http://gw:1 --api-key {KEY}" in note[2]
    assert "--end" in note[3]


def test_without_an_admin_key_the_demo_exits_1(
    demo: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        demo.main(["http://127.0.0.1:9"], {})
    assert exited.value.code == 1
    assert "no admin key given" in capsys.readouterr().out
