"""BrokerConfig: defaults < file (JSON/TOML) < SEDAX_* environment < flags, and clear errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from broker.config import BrokerConfig, ConfigError, add_broker_arguments, build_config, config_from_args
from overlay.geometry import Space


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_broker_arguments(parser)
    return parser.parse_args(argv)


def test_defaults() -> None:
    cfg = build_config({"coord": "0.5,0.25"}, env={})
    assert cfg == BrokerConfig(coord=(0.5, 0.25))
    assert cfg.heartbeat_interval == 0.2 and cfg.heartbeat_misses == 3
    assert cfg.heartbeat_interval * cfg.heartbeat_misses < 1.0  # failover well under a second
    assert cfg.listen == "127.0.0.1:0" and cfg.join == () and cfg.max_hops == 64


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    toml = tmp_path / "b.toml"
    toml.write_text('coord = [0.1, 0.2]\nresilience = 2\nheartbeat-interval = 0.5\njoin = ["h:1"]\nmax_hops = 10\n')
    env = {"SEDAX_RESILIENCE": "3", "SEDAX_JOIN": "a:1,b:2", "SEDAX_HEARTBEAT_INTERVAL": "0.1"}
    cfg = config_from_args(_args("--config", str(toml), "--heartbeat-interval", "0.3"), env=env)
    assert cfg.coord == (0.1, 0.2)  # file
    assert cfg.max_hops == 10  # file
    assert cfg.resilience == 3  # env beats file
    assert cfg.join == ("a:1", "b:2")  # env beats file
    assert cfg.heartbeat_interval == 0.3  # flag beats env


def test_json_file_with_broker_table_and_env_config_path(tmp_path: Path) -> None:
    js = tmp_path / "b.json"
    js.write_text('{"broker": {"coord": "0.3,0.4", "space": [0, 0, 2, 2], "metrics": "127.0.0.1:9100"}}')
    cfg = build_config({}, env={"SEDAX_CONFIG": str(js)})
    assert cfg.coord == (0.3, 0.4)
    assert cfg.space == Space(0, 0, 2, 2)
    assert cfg.metrics == "127.0.0.1:9100"


def test_repeated_and_comma_join_flags() -> None:
    cfg = config_from_args(_args("--coord", "0.5,0.5", "--join", "a:1,b:2", "--join", "c:3"), env={})
    assert cfg.join == ("a:1", "b:2", "c:3")


def test_retention_rules_from_flags_the_environment_and_a_file(tmp_path: Path) -> None:
    rules = ("grid/+/pmu/#=600,16777216", "grid/events/#=604800")
    cfg = config_from_args(_args("--coord", "0.5,0.5", *(a for r in rules for a in ("--retention-topic", r))), env={})
    assert cfg.retention_topics == rules
    assert build_config({"coord": "0.5,0.5"}, env={"SEDAX_RETENTION_TOPICS": " ".join(rules)}).retention_topics == rules
    toml = tmp_path / "b.toml"
    toml.write_text('coord = [0.5, 0.5]\nretention_seconds = 60\nretention_topics = ["grid/+/pmu/#=,1000"]\n')
    policy = build_config({}, env={}, config_file=toml).retention_policy()
    assert policy.of("grid/f1/pmu/a").max_age == 60.0 and policy.of("grid/f1/pmu/a").max_bytes == 1000
    assert policy.of("grid/f1/voltage") == policy.base
    toml.write_text('coord = [0.5, 0.5]\nretention_topics = "grid/#=5"\n')  # (a string, as the variable)
    assert build_config({}, env={}, config_file=toml).retention_topics == ("grid/#=5",)
    toml.write_text("coord = [0.5, 0.5]\nretention_topics = [5]\n")
    with pytest.raises(ConfigError, match="retention_topics must be a list of PATTERN=SECONDS"):
        build_config({}, env={}, config_file=toml)


@pytest.mark.parametrize(
    ("flags", "env", "match"),
    [
        ({}, {}, "coord is required"),
        ({"coord": "1.5,0.5"}, {}, "outside the space"),
        ({"coord": "0.5"}, {}, "coord must be written X,Y"),
        ({"coord": "a,b"}, {}, "two numbers"),
        ({"coord": "0.5,0.5", "listen": "nohost"}, {}, "listen: address must be HOST:PORT"),
        ({"coord": "0.5,0.5", "join": ("h:99999",)}, {}, r"join\[0\]: port must be"),
        ({"coord": "0.5,0.5"}, {"SEDAX_RESILIENCE": "4"}, "resilience must be 1, 2 or 3"),
        ({"coord": "0.5,0.5"}, {"SEDAX_HEARTBEAT_INTERVAL": "soon"}, "environment: heartbeat_interval must be"),
        ({"coord": "0.5,0.5", "heartbeat_interval": -1.0}, {}, "positive number of seconds"),
        ({"coord": "0.5,0.5", "max_hops": 300}, {}, "max_hops must be in 1..255"),
        ({"coord": "0.5,0.5", "space": "0,0,1"}, {}, "four numbers"),
        ({"coord": "0.5,0.5", "space": "0,0,-1,1"}, {}, "positive width"),
        ({"coord": "0.5,0.5", "heartbeat_misses": 1.5}, {}, "heartbeat_misses must be an integer"),
        ({"coord": "0.5,0.5", "balance_scan": 0}, {}, "balance_scan must be >= 1"),
        ({"coord": "0.5,0.5", "ties": "lowest"}, {}, "ties must be random or first"),
        ({"coord": "0.5,0.5"}, {"SEDAX_BOOTSTRAP": "maybe"}, "bootstrap must be true or false"),
        ({"coord": "0.5,0.5", "bootstrap": True}, {}, "give the other brokers with --join"),
        ({"coord": "0.5,0.5"}, {"SEDAX_MAX_MEMORY": "-1"}, r"max_memory must be >= 0 bytes \(0 = half"),
        # Not every number is a duration (it said "publish_rate must be a number of seconds").
        ({"coord": "0.5,0.5"}, {"SEDAX_PUBLISH_RATE": "fast"}, "publish_rate must be a number of publishes per second"),
        ({"coord": "0.5,0.5"}, {"SEDAX_MIN_GAIN": "x"}, r"min_gain must be a number \(a fraction of the load"),
        ({"coord": "0.5,0.5", "retention_topics": ("grid/+/pmu",)}, {}, "has no PATTERN=: give PATTERN=SECONDS"),
        ({"coord": "0.5,0.5"}, {"SEDAX_RETENTION_TOPICS": "grid/#=-1"}, "SECONDS must be a positive number, got -1"),
        ({"coord": "0.5,0.5", "retention_topics": ("grid/a#=5",)}, {}, "a wildcard must be a whole level"),
    ],
)
def test_errors_name_the_setting(flags: dict[str, object], env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_config(flags, env=env)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        build_config({}, env={}, config_file=tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("coord = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_config({}, env={}, config_file=bad)
    unknown = tmp_path / "u.json"
    unknown.write_text('{"coord": "0.5,0.5", "colour": "red"}')
    with pytest.raises(ConfigError, match="unknown setting 'colour'"):
        build_config({}, env={}, config_file=unknown)


def test_every_default_a_flags_help_names_is_the_configs() -> None:
    """The broker's --help names defaults as literals ("(3600)", "(64 MiB)", "(default 2)": broker/flags.py does
    not import the configuration, to keep `sedax --help` fast); each must be BrokerConfig's own default."""
    import dataclasses
    import re

    parser = argparse.ArgumentParser()
    add_broker_arguments(parser)
    cfg = BrokerConfig(coord=(0.5, 0.5))
    names = {f.name for f in dataclasses.fields(BrokerConfig)}
    units = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    checked = []
    for action in parser._actions:
        m = re.search(r"\((?:default )?(-?[0-9][0-9.,]*)(?: ([KMG]iB))?[),]", action.help or "")
        value = getattr(cfg, action.dest, None) if action.dest in names else None
        if m is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue  # (no literal default, or not a number: --space's X,Y,X,Y)
        said = float(m.group(1).replace(",", "")) * units[m.group(2) or ""]
        assert said == float(value), f"--{action.dest} help says {m.group(0)!r}, the configuration's default is {value}"
        checked.append(action.dest)
    assert len(checked) >= 30 and "resilience" in checked and "retention_bytes" in checked
