"""The CLI is generated from the config: every field is a flag, with the config's choices and types."""

from __future__ import annotations

import pytest

from deployments.cli import SKIPPED, build_parser, parse_args
from deployments.config import AppConfig
from ops.telemetry.tracing import TracingConfig
from replicas.config import EngineConfig


def test_every_config_field_is_a_flag():
    dests = {a.dest for a in build_parser()._actions}
    fields = ({f for f in AppConfig.model_fields if f not in SKIPPED} | set(EngineConfig.model_fields)
              | {f"tracing_{f}" for f in TracingConfig.model_fields})
    assert fields <= dests, sorted(fields - dests)


def test_flags_reach_the_config_with_their_types():
    args = parse_args(["--model", "smollm2-135m-instruct", "--persistent-decoder", "off", "--max-model-len", "512",
                       "--no-pipeline-quanta", "--pdl", "--moe-backend", "reference", "--moe-tiles", "{}",
                       "--tracing-exporter", "console", "--spillover-wait-s", "0.25",
                       "--standard-pool", '{"max_replicas": 3}'])
    assert args.pop("host") == "127.0.0.1" and args.pop("port") == 8000
    config = AppConfig.from_args(args)
    assert config.persistent_decoder.value == "off" and config.spillover_wait_s == 0.25
    assert config.engine.max_model_len == 512 and config.engine.pipeline_quanta is False and config.engine.pdl
    assert config.engine.moe_backend == "reference" and config.tracing.exporter == "console"
    assert config.standard_pool.max_replicas == 3
    bare = parse_args([])
    assert set(bare) == {"host", "port"}  # unset flags are not passed: the config's defaults apply


def test_bad_choices_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--moe-backend", "mma"])
    assert "invalid choice: 'mma'" in capsys.readouterr().err


def test_serve_run_strings_for_structured_fields_are_json():
    """``serve run deployments.app:build_app moe_tiles='{...}'`` passes strings: dicts, lists and pool
    settings are parsed as JSON, plain fields are left to pydantic."""
    config = AppConfig.from_args({"moe_tiles": "{}", "cuda_graph_batch_sizes": "[1, 2, 4]", "max_model_len": "512",
                                  "standard_pool": '{"max_replicas": 2}', "pipeline_quanta": "false"})
    assert config.engine.moe_tiles == {} and config.engine.cuda_graph_batch_sizes == (1, 2, 4)
    assert config.engine.max_model_len == 512 and config.standard_pool.max_replicas == 2
    assert config.engine.pipeline_quanta is False
    with pytest.raises(ValueError, match="moe_tiles: expected JSON"):
        AppConfig.from_args({"moe_tiles": "down_pairs=1"})


def test_help_shows_every_default():
    """``--help`` names the default of every flag (the config's, not argparse's None)."""
    helps = {a.option_strings[0]: a.help for a in build_parser()._actions if a.option_strings}
    assert helps["--persistent-decoder"].endswith("(default: auto)")
    assert helps["--max-model-len"].endswith(f"(default: {EngineConfig().max_model_len})")
    assert helps["--spillover-wait-s"].endswith("(default: 0.5)")
    assert helps["--direct-stream"].endswith("(default: true)")
    assert helps["--tracing-exporter"].endswith("(default: unset)")  # then OTEL_TRACES_EXPORTER, else none
    assert '"max_ongoing_requests": 1' in helps["--persistent-pool"]
    assert "default 8000" in helps["--port"]
    for flag, text in helps.items():
        assert flag == "-h" or "default" in text, flag
    assert "(default: " in build_parser().format_help()  # argparse formats them (no stray %)


def test_topology_is_a_choice_and_direct_needs_the_persistent_decoder(capsys):
    args = parse_args(["--topology", "direct"])
    args.pop("host"), args.pop("port")
    config = AppConfig.from_args(args)
    assert config.direct and config.persistent_enabled and not config.colocated
    assert not AppConfig().direct  # pools by default
    with pytest.raises(SystemExit):
        parse_args(["--topology", "mesh"])
    assert "invalid choice: 'mesh'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="topology=direct needs persistent-decoder auto or required"):
        AppConfig.from_args({"topology": "direct", "persistent_decoder": "off"})
