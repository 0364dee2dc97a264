"""Settings: typed parsing from the environment, overrides, fail-fast messages, docs table."""

from __future__ import annotations

import pytest

from omniflow.cli.main import _settings_table
from omniflow.config import CommonSettings, SettingsError, load_settings
from omniflow_services.worker.config import WorkerSettings


def test_defaults_without_environment() -> None:
    s = load_settings(WorkerSettings, env={})
    assert s.role == "llm" and s.port == 0 and s.discovery == "redis"
    assert s.registration_ttl_s == 5.0


def test_environment_is_typed_and_flags_override() -> None:
    env = {
        "OMNIFLOW_PORT": "7001",
        "OMNIFLOW_REGISTRATION_TTL_S": "2.5",
        "OMNIFLOW_HOST": "0.0.0.0",
    }
    s = load_settings(CommonSettings, env=env, overrides={"port": "7002"})
    assert s.port == 7002 and s.registration_ttl_s == 2.5 and s.host == "0.0.0.0"
    with pytest.raises(AttributeError):
        s.port = 1  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OMNIFLOW_PORT": "eighty"}, "OMNIFLOW_PORT='eighty' is not an integer"),
        ({"OMNIFLOW_PORT": "-3"}, "OMNIFLOW_PORT=-3 is below the minimum 0"),
        ({"OMNIFLOW_DISCOVERY": "zookeeper"}, "accepted: redis, consul, static"),
        ({"OMNIFLOW_WORKER_ROLE": "chef"}, "OMNIFLOW_WORKER_ROLE='chef' is not accepted"),
        ({"OMNIFLOW_REGISTRATION_TTL_S": "0.1"}, "below the minimum 0.5"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(WorkerSettings, env=env)
    assert message in str(err.value)


def test_settings_table_lists_every_variable_once() -> None:
    table = _settings_table()
    for var in (
        "OMNIFLOW_PORT",
        "OMNIFLOW_WORKER_ROLE",
        "OMNIFLOW_KV_SSD_PATH",
        "CONSUL_HTTP_ADDR",
    ):
        assert table.count(f"`{var}`") == 1


def test_readme_settings_table_matches_the_code() -> None:
    from pathlib import Path

    from omniflow.cli.main import readme_with_settings

    readme = Path(__file__).resolve().parent.parent / "README.md"
    text = readme.read_text()
    assert text == readme_with_settings(text), (
        "README.md's settings table is out of date: run `omniflow settings --write README.md`"
    )
