"""An AWS credential chain that finds nothing, for the tests of what a
store says then."""

from __future__ import annotations

from pathlib import Path

import pytest


def without_aws_credentials(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """No credentials where botocore looks: none in the environment, a
    ``home`` whose files hold none (``home / "config"`` is the config file a
    test may write), no instance metadata."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
