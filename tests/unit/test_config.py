from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.cli import main
from shared.config import ConductorConfig, GatewayConfig, ServiceConfig, WorkerConfig
from shared.config_loading import add_config_flags, flat_fields, load_config
from shared.errors import ConfigError


def test_defaults_apply_without_any_source() -> None:
    config = load_config(GatewayConfig)
    assert (config.host, config.port, config.model) == ("127.0.0.1", 8000, "halfmoon-tiny")


def test_flags_beat_environment_which_beats_file(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_text('port = 7000\nmodel = "from-file"\nmax_model_len = 512\n')
    env = {"HALFMOON_PORT": "7100", "HALFMOON_MODEL": "from-env", "OTHER": "x"}
    config = load_config(GatewayConfig, flags={"port": "7200", "model": None}, env=env,
                         toml_path=path)
    assert (config.port, config.model, config.max_model_len) == (7200, "from-env", 512)


def test_environment_strings_are_converted_to_field_types() -> None:
    config = load_config(WorkerConfig, env={"HALFMOON_FAKE_TOKEN_DELAY_S": "0.25",
                                            "HALFMOON_NUM_BLOCKS": "64"})
    assert (config.fake.token_delay_s, config.engine.num_blocks) == (0.25, 64)


def test_bad_value_raises_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="port"):
        load_config(GatewayConfig, flags={"port": "eighty"})


def test_unknown_engine_is_refused() -> None:
    with pytest.raises(ConfigError, match="engine"):
        load_config(WorkerConfig, flags={"engine": "gpt"})


def test_unknown_key_in_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("prot = 1\n")
    with pytest.raises(ConfigError, match="prot"):
        load_config(GatewayConfig, toml_path=path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(GatewayConfig, toml_path=tmp_path / "nope.toml")


def test_every_field_gets_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, WorkerConfig)
    args = parser.parse_args(["--nats-url", "nats://h:1", "--fake-token-delay-s", "0.1"])
    config = load_config(WorkerConfig, flags=vars(args))
    assert (config.nats_url, config.fake.token_delay_s) == ("nats://h:1", 0.1)


def test_nested_settings_keep_their_flat_names_everywhere(tmp_path: Path) -> None:
    path = tmp_path / "worker.toml"
    path.write_text('num_blocks = 32\n[transfer]\ntransfer_host = "0.0.0.0"\n'
                    '[sim]\nsim_time_scale = 2.5\n')
    config = load_config(WorkerConfig, toml_path=path, env={"HALFMOON_KV_STREAMING": "whole"},
                         flags={"engine": "sim"})
    assert (config.engine.kind, config.engine.num_blocks) == ("sim", 32)
    assert (config.transfer.host, config.transfer.kv_streaming) == ("0.0.0.0", "whole")
    assert config.sim.time_scale == 2.5


def test_a_literal_setting_offers_its_choices_as_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, WorkerConfig)
    with pytest.raises(SystemExit):
        parser.parse_args(["--engine", "gpt"])
    assert parser.parse_args(["--engine", "sim"]).engine == "sim"


@pytest.mark.parametrize("config_type", [GatewayConfig, ConductorConfig, WorkerConfig])
def test_every_setting_says_what_it_does_in_its_help(config_type: type[ServiceConfig]
                                                     ) -> None:
    undescribed = [field.name for field in flat_fields(config_type) if not field.about]
    assert undescribed == []
    parser = argparse.ArgumentParser()
    add_config_flags(parser, config_type)
    shown = " ".join(parser.format_help().split())
    assert "--nats-url NATS_URL, --nats NATS_URL the NATS server; several servers" in shown


def test_a_settings_help_gives_its_default() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, WorkerConfig)
    shown = " ".join(parser.format_help().split())
    assert "--block-size BLOCK_SIZE tokens per KV block (at least 1; default: 16)" in shown
    assert "on CUDA, the share of device memory for weights + KV (above 0, at most 1; " \
        "default: 0.9)" in shown
    assert "reuse the KV of prompt prefixes computed before (default: True)" in shown


def test_the_published_settings_reference_is_current(tmp_path: Path) -> None:
    published = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
    assert main(["settings", "--out", str(tmp_path / "settings.md")]) == 0
    assert (tmp_path / "settings.md").read_text() == published.read_text(), \
        "run `halfmoon settings --out docs/settings.md` and commit it"
    for field in flat_fields(WorkerConfig) + flat_fields(ConductorConfig):
        assert f"`{field.flag}`" in published.read_text()


@pytest.mark.parametrize(("config_type", "setting", "value"), [
    (WorkerConfig, "max_batch_tokens", "0"), (WorkerConfig, "block_size", "-16"),
    (WorkerConfig, "sim_time_scale", "0"), (GatewayConfig, "port", "70000"),
    (ConductorConfig, "ttft_slo_ms", "-5"), (ConductorConfig, "trace_sample_ratio", "1.5")])
def test_a_setting_out_of_its_range_is_refused_by_its_flag_and_variable(
        config_type: type[ServiceConfig], setting: str, value: str) -> None:
    """A zero batch budget once left every prompt waiting forever."""
    flag, variable = "--" + setting.replace("_", "-"), "HALFMOON_" + setting.upper()
    with pytest.raises(ConfigError, match=f"invalid {flag} \\({variable}\\)"):
        load_config(config_type, env={variable: value})
