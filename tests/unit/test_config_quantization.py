"""`quantization:` in the YAML (top level or a section) and `pdserve serve --quantization`: its values,
errors that name the key and the file, and one quantization for every server of a deployment."""

from __future__ import annotations

import pytest
from config_files import write

from server.cli import build_parser
from server.config.schema import (
    ConfigError,
    load_deployment,
    load_server_config,
    server_config_from_dict,
)

pytestmark = pytest.mark.usefixtures("no_env_overrides")


def disagg(**extra) -> dict:
    return {"model": "builtin:tiny-llama", "context_servers": {"urls": ["127.0.0.1:8001"]},
            "generation_servers": {"urls": ["127.0.0.1:8002"]}, **extra}


def test_quantization_defaults_to_the_checkpoint_and_takes_fp8(tmp_path):
    assert load_server_config(write(tmp_path, {"model": "m"})).quantization is None
    assert load_server_config(write(tmp_path, {"model": "m", "quantization": "fp8"})).quantization == "fp8"
    assert load_server_config(write(tmp_path, {"model": "m", "quantization": None})).quantization is None
    cfg = load_deployment(write(tmp_path, disagg(quantization="fp8")))
    assert [s.quantization for s in cfg.servers] == ["fp8", "fp8"]  # the top level's, inherited


def test_an_unknown_quantization_is_refused_naming_the_key_and_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"bad\.yaml: quantization: must be one of fp8, got 'int4'$"):
        load_server_config(write(tmp_path, {"model": "m", "quantization": "int4"}, "bad.yaml"))
    data = disagg()
    data["generation_servers"]["quantization"] = "fp4"
    with pytest.raises(ConfigError, match=r"bad\.yaml: generation_servers\.quantization: must be one of fp8, "
                                          r"got 'fp4'$"):
        load_deployment(write(tmp_path, data, "bad.yaml"))


def test_every_server_of_a_deployment_serves_the_same_weights(tmp_path):
    data = disagg()
    data["context_servers"]["quantization"] = "fp8"  # a section may set it, but not for one side only
    with pytest.raises(ConfigError, match=r"x\.yaml: quantization: every server must serve the same weights, got "
                                          r"\['None', 'fp8'\] \(set it at the top level\)"):
        load_deployment(write(tmp_path, data))
    data["generation_servers"]["quantization"] = "fp8"
    assert {s.quantization for s in load_deployment(write(tmp_path, data)).servers} == {"fp8"}


def test_serve_takes_quantization_on_the_command_line(capsys):
    args = build_parser().parse_args(["serve", "builtin:tiny-llama", "--quantization", "fp8"])
    assert args.quantization == "fp8"
    assert server_config_from_dict({"model": args.model, "quantization": args.quantization}).quantization == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "builtin:tiny-llama", "--quantization", "int8"])
    assert "argument --quantization: invalid choice: 'int8'" in capsys.readouterr().err
