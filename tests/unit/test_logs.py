"""One stderr line per record, `extra` fields as key=value (agent.logs)."""

from __future__ import annotations

import logging

from agent import logs


def _line(record: logging.LogRecord, fmt: str = "%(levelname)s %(name)s: %(message)s") -> str:
    return logs.KeyValueFormatter(fmt).format(record)


def test_extra_fields_follow_the_message_in_order_and_standard_ones_never():
    record = logging.makeLogRecord(
        {"name": "agent.x", "levelname": "WARNING", "msg": "pod step failed", "pod": "ns/web"}
    )
    record.error = "boom"
    assert _line(record) == "WARNING agent.x: pod step failed pod=ns/web error=boom"


def test_a_record_without_extras_is_the_format_alone():
    record = logging.makeLogRecord({"name": "agent.x", "levelname": "INFO", "msg": "ready"})
    assert _line(record) == "INFO agent.x: ready"


def test_setup_installs_one_stderr_handler_and_an_unknown_level_means_info(capsys):
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        logs.setup("debug")
        logs.setup("loud", "%(levelname)s %(message)s key")
        assert len(root.handlers) == 1
        assert root.level == logging.INFO
        logging.getLogger("agent.t").info("hello", extra={"n": 1})
        logging.getLogger("agent.t").debug("hidden")
        assert capsys.readouterr().err == "INFO hello key n=1\n"
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
