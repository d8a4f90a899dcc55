"""``run`` merges an extension's options into the caller's command the way vLLM will read
it (manager-protocol.md §6.2 steps 4-5): vLLM's parser takes either spelling of an
option's dashes (``--additional_config``), uses the last of repeated occurrences, and
builds a JSON option from ``--opt.key V`` arguments that replace the whole object. A caller's
value in any of those places that differs from the extension's is a conflict; an equal one
is accepted; the extension's ``additional_config`` keys go into the occurrence vLLM reads.

The rendered commands are parsed by vLLM 0.33.0's own ``FlexibleArgumentParser`` with the
engine's arguments (stock vLLM has no ``--preemption-policy``; ``--scheduler-cls`` is the
scalar option merged the same way)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hust_ext_manager.launch import merge_additional_config, merge_option


@pytest.fixture(scope="module")
def vllm_parser() -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def test_bundle_keys_go_into_the_occurrence_vllm_reads(vllm_parser: Any) -> None:
    command = ["--additional-config", '{"k": 1}', "--additional-config", '{"x": 2}']
    merged = merge_additional_config(command, {"k": 1, "bidkv": {"enabled": True}})
    seen = vllm_parser.parse_args(merged).additional_config
    assert seen == {"x": 2, "k": 1, "bidkv": {"enabled": True}}


def test_a_different_value_under_the_underscore_spelling_conflicts(vllm_parser: Any) -> None:
    command = ["--additional_config", '{"k": 2}']
    assert vllm_parser.parse_args(command).additional_config == {"k": 2}  # vLLM reads it
    with pytest.raises(ValueError, match=r"conflicts with additional_config keys: \['k'\]"):
        merge_additional_config(command, {"k": 1})
    merged = merge_additional_config(["--additional_config={\"x\": 1}"], {"k": 1})
    assert vllm_parser.parse_args(merged).additional_config == {"x": 1, "k": 1}


@pytest.mark.parametrize(
    "command",
    [["--scheduler-cls", "a.B", "--scheduler-cls", "c.D"],
     ["--scheduler-cls=c.D", "--scheduler-cls", "a.B"],
     ["--scheduler_cls", "c.D"]],
    ids=["later-differs", "earlier-differs", "underscore"],
)
def test_a_caller_value_anywhere_that_differs_conflicts(
    vllm_parser: Any, command: list[str]
) -> None:
    with pytest.raises(ValueError, match=r"^extension activation conflicts with --scheduler-cls$"):
        merge_option(command, "--scheduler-cls", "a.B", is_json=False)


def test_equal_values_in_every_spelling_are_accepted_unchanged(vllm_parser: Any) -> None:
    command = ["--scheduler_cls=a.B", "--scheduler-cls", "a.B"]
    assert merge_option(command, "--scheduler-cls", "a.B", is_json=False) == command
    assert vllm_parser.parse_args(command).scheduler_cls == "a.B"
    json_command = ["--speculative_config", json.dumps({"n": 1})]
    assert merge_option(json_command, "--speculative-config", {"n": 1}, is_json=True) \
        == json_command


def test_a_per_key_argument_of_a_merged_json_option_is_refused(vllm_parser: Any) -> None:
    command = ["--additional-config", '{"k": 1}', "--additional_config.k", "2"]
    # What vLLM would do: the per-key object replaces the whole JSON one.
    assert vllm_parser.parse_args(command).additional_config == {"k": 2}
    with pytest.raises(ValueError, match=r"^--additional_config\.k cannot be merged with the "
                       r"extension's --additional-config: give --additional-config one JSON "
                       r"object instead$"):
        merge_additional_config(command, {"k": 1})
