"""Settings: defaults, environment, the TOML file, and refusing what makes no sense."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatcher.contract.exits import EXIT_CONFIG
from dispatcher.contract.settings import Settings, SettingsError, load_settings
from testkit import run_cli

DIGEST = "a" * 64


def test_defaults() -> None:
    settings = Settings()
    assert settings.class_names == ["interactive", "batch"]
    assert settings.default_class == "batch"
    assert settings.classes["interactive"].reject_without_workers is True
    assert settings.classes["batch"].reject_without_workers is False
    assert settings.class_timeout_s("batch") == settings.default_timeout_s
    assert settings.redis_url is None and settings.redis_url_or_default.startswith("redis://")


def test_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULANE_PORT", "9123")
    monkeypatch.setenv("GPULANE_CLASSES", '{"rt": {"max_queued": 5}, "bulk": {}}')
    monkeypatch.setenv("GPULANE_DEFAULT_CLASS", "bulk")
    settings = load_settings()
    assert settings.port == 9123
    assert settings.class_names == ["rt", "bulk"]
    assert settings.classes["rt"].max_queued == 5
    assert settings.openai_task_class == "bulk"  # no interactive class: the default one


def test_toml_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "gpulane.toml"
    config.write_text(
        f"""
max_file_bytes = 4096
[classes.interactive]
max_queued = 7
max_wait_s = 3
reject_without_workers = true
[classes.batch]
max_queued = 100
[types.embed]
batch_max_size = 16
[types."test.batch_echo"]
batch_max_wait_ms = 0
[[tenants]]
name = "acme"
key_sha256 = "{DIGEST}"
rate = 5
burst = 10
classes = ["batch"]
"""
    )
    monkeypatch.setenv("GPULANE_CONFIG", str(config))
    settings = load_settings()
    assert settings.max_file_bytes == 4096
    assert settings.class_names == ["interactive", "batch"]
    assert settings.classes["interactive"].max_wait_s == 3
    assert settings.tenants[0].name == "acme" and settings.tenants[0].key_sha256 == [DIGEST]
    assert settings.types["embed"].batch_max_size == 16
    assert settings.types["embed"].batch_max_wait_ms is None  # the type's own
    assert settings.types["test.batch_echo"].batch_max_wait_ms == 0
    monkeypatch.setenv("GPULANE_MAX_FILE_BYTES", "8192")  # environment beats the file
    assert load_settings().max_file_bytes == 8192


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("colour = 'blue'", "colour"),
        ("[classes.batch]\nmax_queue = 3", "max_queue"),
        (f"[[tenants]]\nname = 'x'\nkey_sha256 = '{DIGEST}'\nrole = 'admin'", "role"),
        ("[[tenants]]\nname = 'x'\nkey_sha256 = 'not-hex'", "key_sha256"),
        (f"[[tenants]]\nname = 'x'\nkey_sha256 = '{DIGEST}'\nclasses = ['gold']", "gold"),
        ("lease_ttl_s = 0.5\nheartbeat_interval_s = 1", "lease_ttl_s"),
        ("default_class = 'gold'", "default_class"),
        ("[classes.Bad-Name]", "class name"),
        (f"[[tenants]]\nname = ''\nkey_sha256 = '{DIGEST}'", "tenants.0.name"),
        (f"[[tenants]]\nname = 'a:b'\nkey_sha256 = '{DIGEST}'", "tenants.0.name"),
        ("[[tenants]]\nname = 'x'\nkey_sha256 = []", "tenants.0.key_sha256"),
        (
            f"[[tenants]]\nname = 'x'\nkey_sha256 = '{DIGEST}'\n"
            f"[[tenants]]\nname = 'x'\nkey_sha256 = '{'b' * 64}'",
            "tenant names must be unique",
        ),
        (
            f"[[tenants]]\nname = 'x'\nkey_sha256 = '{DIGEST}'\n"
            f"[[tenants]]\nname = 'y'\nkey_sha256 = '{DIGEST}'",
            "one tenant",
        ),
        ("[classes.batch]\nmax_queued = 0", "classes.batch.max_queued"),
        ("max_body_bytes = -1", "max_body_bytes"),
        ("[types.embed]\nbatch_size = 3", "batch_size"),
        ("[types.embed]\nbatch_max_size = 0", "batch_max_size"),
    ],
)
def test_bad_file_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, needle: str
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text)
    monkeypatch.setenv("GPULANE_CONFIG", str(config))
    with pytest.raises(SettingsError, match=needle):
        load_settings()


def test_missing_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPULANE_CONFIG", str(tmp_path / "nope.toml"))
    with pytest.raises(SettingsError, match="not a readable file"):
        load_settings()


@pytest.mark.parametrize("command", ["api", "worker", "up", "status", "submit"])
def test_every_command_refuses_a_bad_config(tmp_path: Path, command: str) -> None:
    """A real process: exit 2, one paragraph on stderr naming the key, no traceback."""
    config = tmp_path / "bad.toml"
    config.write_text(f"[[tenants]]\nname = ''\nkey_sha256 = '{DIGEST}'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULANE_")}
    env["GPULANE_CONFIG"] = str(config)
    args = ["--type", "echo"] if command == "submit" else []
    done = run_cli(command, *args, env=env)
    assert done.returncode == EXIT_CONFIG == 2
    assert "Traceback" not in done.stderr
    message = done.stderr.strip()
    assert "\n" not in message and "tenants.0.name" in message, message


@pytest.mark.parametrize(
    "url",
    ["redis://h:6379/0", "rediss://:secret@h:6380/1", "unix:///tmp/r.sock?db=2", "redis://"],
)
def test_redis_urls_redis_py_takes_are_accepted(url: str) -> None:
    assert load_settings(redis_url=url).redis_url == url


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("notaurl", "schemes"),
        ("http://h:6379", "schemes"),
        ("redis://h:port/0", "Port"),
        ("redis://h:99999/0", "Port"),
        ("redis://h/0?socket_timeout=soon", "socket_timeout"),
    ],
)
def test_a_bad_redis_url_is_a_settings_error(url: str, why: str) -> None:
    with pytest.raises(SettingsError, match=f"redis_url: not a Redis URL.*{why}"):
        load_settings(redis_url=url)


@pytest.mark.parametrize("command", ["api", "worker", "catalog", "up"])
@pytest.mark.parametrize("given", ["env", "flag"])
def test_every_redis_command_refuses_a_bad_redis_url(command: str, given: str) -> None:
    """A real process: the URL is refused at start (exit 2, one line), not by a
    traceback at the first connection, and a password in it is not echoed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULANE_")}
    url = "notaurl://:hunter2@h"
    args = ["--redis-url", url] if given == "flag" else []
    if given == "env":
        env["GPULANE_REDIS_URL"] = url
    done = run_cli(command, *args, env=env)
    assert done.returncode == EXIT_CONFIG == 2, done.stderr
    assert "Traceback" not in done.stderr
    message = done.stderr.strip()
    assert "\n" not in message and "redis_url: not a Redis URL" in message, message
    assert "hunter2" not in message
