"""The daemon's log format: logfmt lines, one event a line, with the noisy
SDK loggers held at warnings."""

from __future__ import annotations

import logging
import sys
import time

# What starts a warning line on the ready pipe (``_ReadyPipe``).
WARNING_PREFIX = "warning: "


# Libraries that log request details at debug level (azure-core every
# request at info, azure-identity each credential it tries); keep them
# quiet so no header or URL can reach the log.
_QUIET_LOGGERS = ("botocore", "aiobotocore", "boto3", "urllib3", "google", "aiohttp", "azure", "msal")


class LogfmtFormatter(logging.Formatter):
    """One line per event, ``key=value`` (logfmt), so journald, Loki or
    ``grep`` can take it apart; a traceback is folded into the line."""

    def format(self, record: logging.LogRecord) -> str:
        fields = [
            ("ts", self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z"),
            ("level", record.levelname.lower()),
            ("logger", record.name),
            ("msg", record.getMessage()),
        ]
        if record.exc_info:
            fields.append(("exc", self.formatException(record.exc_info)))
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in fields)


def _logfmt_value(value: str) -> str:
    if value and not any(char in value for char in ' "=\n\\'):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    formatter = LogfmtFormatter()
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    logging.basicConfig(level=level.upper(), handlers=[handler])
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
