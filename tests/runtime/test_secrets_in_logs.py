"""Secrets are masked wherever they are held, and no log line can carry one, tracebacks included."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.dataproxy.settings import DataProxySettings
from services.gateway.settings import GatewaySettings
from services.runtime.secret import Secret, matches_any, scrub, secrets_in
from services.worker.settings import WorkerSettings
from tests.harness.secret_scan import IssuedSecrets, scan

ADMIN = "rg-admin-secret-value-0123456789"
TRAINER = "trainer-secret-value-0123456789"
UPSTREAM = "upstream-secret-value-0123456789"
SESSION = "sk-sess-" + "A1b2C3d4E5f6" * 3 + "G7h8I9j"


def test_a_secret_never_shows_its_value() -> None:
    secret = Secret(ADMIN)
    for text in (str(secret), repr(secret), f"{secret}", f"{secret!r}", format(secret, ">3")):
        assert ADMIN not in text
    assert repr([secret, {"k": secret}]).count("***") == 2
    assert secret.reveal() == ADMIN
    assert secret.matches(ADMIN) and secret.matches(ADMIN.encode())
    assert not secret.matches(ADMIN + "x") and not Secret("").matches("")
    with pytest.raises(TypeError):
        pickle.dumps(secret)


def test_matches_any_accepts_each_key_of_a_set() -> None:
    keys = (Secret(ADMIN), Secret(TRAINER))
    assert matches_any(keys, TRAINER) and matches_any(keys, ADMIN)
    assert not matches_any(keys, UPSTREAM) and not matches_any((), ADMIN)


def test_settings_hold_every_key_masked() -> None:
    gateway = GatewaySettings.from_env({"ROLLGATE_ADMIN_KEY": ADMIN})
    dataproxy = DataProxySettings.from_env(
        {"ROLLGATE_ADMIN_KEY": ADMIN, "ROLLGATE_TRAINER_KEY": TRAINER}
    )
    worker = WorkerSettings.from_env(
        {"ROLLGATE_UPSTREAM_BASE_URL": "http://x/v1", "ROLLGATE_UPSTREAM_API_KEY": UPSTREAM}
    )
    for settings, held in ((gateway, [ADMIN]), (dataproxy, [ADMIN, TRAINER]), (worker, [UPSTREAM])):
        text = repr(settings) + str(settings)
        assert not any(value in text for value in held), text
        assert sorted(s.reveal() for s in secrets_in(settings)) == sorted(held)


def test_scrub_masks_known_values_and_key_shapes() -> None:
    text = f"admin={ADMIN} session={SESSION} hdr='Authorization: Bearer {UPSTREAM}'"
    scrubbed = scrub(text, [ADMIN])
    assert ADMIN not in scrubbed and SESSION not in scrubbed and UPSTREAM not in scrubbed
    assert "sk-sess-***" in scrubbed and "Bearer ***" in scrubbed


# Runs in its own process: logging is process-wide, and this is how services configure it.
_LOGGING_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    from services.gateway.settings import GatewaySettings
    from services.runtime.logs import configure_logging, get_logger
    from services.runtime.secret import Secret, secrets_in

    ADMIN, TRAINER, UPSTREAM, SESSION, JSON = sys.argv[1:6]
    settings = GatewaySettings.from_env({"ROLLGATE_ADMIN_KEY": ADMIN})
    configure_logging(
        service="t", json_logs=JSON == "1", level="debug",
        secrets=[*secrets_in(settings), Secret(TRAINER), Secret(UPSTREAM)],
    )
    log = get_logger("t")

    def handler(settings, key, headers, raw_admin):
        upstream_header = "Bearer " + UPSTREAM
        raise RuntimeError(f"failed for {key} with {raw_admin}")

    try:
        handler(settings, SESSION, {"Authorization": "Bearer " + SESSION}, ADMIN)
    except RuntimeError:
        log.exception("unhandled_error", headers={"Authorization": "Bearer " + SESSION})
    log.info("event", api_key=UPSTREAM, detail="trainer " + TRAINER, nested={"x": [ADMIN]})
    try:
        handler(settings, SESSION, {}, TRAINER)
    except RuntimeError:
        logging.getLogger("aiohttp.server").exception("Error handling request %s", SESSION)
    logging.getLogger("grpc").warning("peer said %s", "Bearer " + UPSTREAM)
    """
)


@pytest.mark.parametrize("json_logs", ["1", "0"])
def test_no_log_line_carries_a_secret_tracebacks_included(json_logs: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LOGGING_SCRIPT, ADMIN, TRAINER, UPSTREAM, SESSION, json_logs],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    output = done.stdout + done.stderr
    for value in (ADMIN, TRAINER, UPSTREAM, SESSION):
        assert value not in output, output
    # The lines are there (with their tracebacks), only masked.
    assert output.count("RuntimeError") >= 2, output
    assert "unhandled_error" in output and "Error handling request" in output
    assert "peer said" in output
    assert "raw_admin" not in output.replace("raw_admin):", ""), "frame locals were rendered"
    if json_logs == "1":
        lines = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
        assert {line.get("service") for line in lines} == {"t"}
        assert all("locals" not in json.dumps(line) for line in lines)


def test_the_log_scan_finds_registered_keys_and_any_session_key(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "gateway.log").write_text(f'{{"event": "ok"}}\n{{"key": "{ADMIN}"}}\nclean\n')
    (logs / "worker.log").write_text(f"x {SESSION} y\nsk-sess-*** masked\n")
    issued = IssuedSecrets()
    issued.add(ADMIN, "")
    issued.add_env({"ROLLGATE_TRAINER_KEY": TRAINER, "ROLLGATE_UPSTREAM_API_KEY_VAR": "NAME"})
    issued.watch(logs)
    scanned = scan(issued)
    assert scanned.lines == 5 and scanned.silent == []
    assert sorted((leak.path.name, leak.line_number) for leak in scanned.leaks) == [
        ("gateway.log", 2),
        ("worker.log", 1),
    ]
    assert issued.values == {ADMIN, TRAINER}


def test_the_log_scan_reports_a_watched_directory_without_a_line(tmp_path: Path) -> None:
    issued = IssuedSecrets()
    (tmp_path / "written").mkdir()
    (tmp_path / "written" / "gateway.log").write_text('{"event": "ok"}\n')
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "worker.log").write_text("")
    for name in ("written", "empty", "never-created"):
        issued.watch(tmp_path / name)
    scanned = scan(issued)
    assert scanned.lines == 1 and not scanned.leaks
    assert scanned.silent == [tmp_path / "empty", tmp_path / "never-created"]
