"""BidKVConfig: inert by default, kill switch wins, precedence, one-line errors naming
the source. An inactive policy asks the host for no facts; ``from_vllm_config`` ignores an
``additional_config`` that is not a mapping and engine facts that are not a positive block
size or a boolean prefix-caching flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

from bidkv_ext import BidKVConfig, BidkvPreemptionPolicy, ConfigError
from bidkv_ext.config import REFERENCE_KEYS
from tests.policy_helpers import cand, ctx


def test_defaults_are_inert_and_kill_switch_wins() -> None:
    assert not BidKVConfig().is_active
    assert BidKVConfig(enabled=True).is_active
    assert not BidKVConfig(enabled=True, kill_switch=True).is_active
    context = ctx([cand("a", computed=10), cand("b", computed=900)])
    assert BidkvPreemptionPolicy(BidKVConfig()).select_victim(context) is None
    killed = BidkvPreemptionPolicy(BidKVConfig(enabled=True, kill_switch=True))
    assert killed.select_victim(context) is None
    assert BidkvPreemptionPolicy(BidKVConfig(enabled=True)).select_victim(context) is not None


def test_an_inactive_policy_wants_no_host_facts() -> None:
    """Computing facts costs the host a pass over the block tables; an inactive policy
    (disabled, or kill switch on) abstains without reading them, so it asks for none."""
    assert BidkvPreemptionPolicy(BidKVConfig(enabled=True)).wants_host_facts
    assert not BidkvPreemptionPolicy(BidKVConfig()).wants_host_facts
    assert not BidkvPreemptionPolicy(BidKVConfig(enabled=True, kill_switch=True)).wants_host_facts


def test_manifest_activation_restates_the_defaults() -> None:
    """The bundle's activation environment only switches the policy on: every other value
    it sets is the config default, so a manager launch and a direct load behave alike (and
    a changed default cannot leave the manifest behind)."""
    root = Path(__file__).resolve().parents[1]
    manifest = root / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json"
    environment = json.loads(manifest.read_text())["activation"]["environment"]
    launched = BidKVConfig.from_sources(None, environment)
    assert launched.is_active
    assert launched == BidKVConfig(enabled=True)
    assert BidKVConfig().liveness_preemptions == int(
        environment["BIDKV_UTILITY_LIVENESS_PREEMPTIONS"])


def test_score_parameters_come_from_the_config() -> None:
    """UtilityParams (the plain dataclass the hot path reads) takes every score field from
    BidKVConfig, which owns the defaults: a strategy built without a config scores like
    the shipped policy, and a configured value reaches the score."""
    from bidkv_ext.strategies.utility import UtilityParams, UtilityStrategy

    params = UtilityParams.from_config(BidKVConfig())
    assert UtilityStrategy().params == params == UtilityParams.from_config()
    assert params.base_cost == BidKVConfig().base_cost
    tuned = UtilityParams.from_config(BidKVConfig(preempt_weight=2.0, block_size=32))
    assert (tuned.preempt_weight, tuned.block_size) == (2.0, 32)


def test_configured_preempt_weight_scales_delta_by_one_plus_weight_times_p() -> None:
    """preempt_weight reaches the score: delta carries the factor (1 + preempt_weight * P)
    (docs/policy.md, "delta"), so with weight 2 a victim preempted P times has exactly
    (1 + 2P) times the delta of the same victim never preempted, and weight 0 (the
    default) leaves P out."""
    from bidkv_ext.strategies.utility import UtilityParams, UtilityStrategy

    # Completion term off so that delta is (base_cost + lost) * (1 + 2P) exactly.
    config = BidKVConfig(preempt_weight=2.0, completion_weight=0.0)
    tuned = UtilityStrategy(UtilityParams.from_config(config))
    eps = config.epsilon
    # 320 computed tokens: 20 blocks freed, need 1 -> r = 1; lost = 320 (cache_survival 0).
    for p in (0, 1, 3):
        victim = cand("v", computed=320, output=10, preemptions=p)
        assert tuned.utility(victim, 1) == pytest.approx(
            1.0 / ((64.0 + 320.0) * (1 + 2 * p) + eps), rel=1e-12)
    fresh = tuned.utility(cand("v", computed=320, output=10), 1)
    twice = tuned.utility(cand("v", computed=320, output=10, preemptions=2), 1)
    assert (1.0 / twice - eps) == pytest.approx(5.0 * (1.0 / fresh - eps), rel=1e-12)
    # The default weight 0: prior preemptions do not move the score.
    plain = UtilityStrategy(UtilityParams.from_config(BidKVConfig(completion_weight=0.0)))
    assert plain.utility(cand("v", computed=320, output=10, preemptions=3), 1) == (
        plain.utility(cand("v", computed=320, output=10), 1))


def test_configured_block_size_sets_blocks_freed() -> None:
    """block_size reaches the score: blocks freed are ceil(computed / block_size) without
    host facts and r = min(blocks freed, blocks needed) (docs/policy.md, "r"). With 32-token
    blocks 100 computed tokens free 4 blocks (not the 7 of 16-token blocks), so a need of 5
    or 7 is capped at 4, a need of 3 at 3; and the partial last block (100 % 32 = 4 tokens)
    is what cache_survival 1 cannot save."""
    from bidkv_ext.strategies.utility import UtilityParams, UtilityStrategy

    config = BidKVConfig(block_size=32, completion_weight=0.0)
    wide = UtilityStrategy(UtilityParams.from_config(config))
    eps = config.epsilon
    victim = cand("v", computed=100, output=10)
    delta = 64.0 + 100.0
    for need, useful in ((1, 1), (3, 3), (4, 4), (5, 4), (7, 4), (50, 4)):
        assert wide.utility(victim, need) == pytest.approx(useful / (delta + eps), rel=1e-12)
    # 16-token blocks free 7 for the same candidate: the setting is what changed it.
    narrow = UtilityStrategy(UtilityParams.from_config(BidKVConfig(completion_weight=0.0)))
    assert narrow.utility(victim, 7) == pytest.approx(7 / (delta + eps), rel=1e-12)
    # Prefix caching, every full block assumed to survive: only 100 - 96 = 4 tokens lost.
    kept = UtilityStrategy(UtilityParams.from_config(
        BidKVConfig(block_size=32, completion_weight=0.0, cache_survival=1.0)))
    assert kept.utility(victim, 5) == pytest.approx(4 / (64.0 + 4.0 + eps), rel=1e-12)


def test_environment_then_additional_config_precedence() -> None:
    env = {"BIDKV_UTILITY_ENABLE": "1", "BIDKV_UTILITY_STRATEGY": "lifo",
           "BIDKV_UTILITY_LIVENESS_PREEMPTIONS": "4"}
    from_env = BidKVConfig.from_sources(None, env)
    assert (from_env.is_active, from_env.strategy, from_env.liveness_preemptions) == (
        True, "lifo", 4)
    both = BidKVConfig.from_sources(
        {"bidkv": {"strategy": "bidkv"}, "preemption_policy": "x.Y",
         "_manager_runtime_qualification": {"status": "passed"}}, env)
    assert both.strategy == "bidkv" and both.liveness_preemptions == 4


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"BIDKV_UTILITY_ENABLE": "maybe"}, "BIDKV_UTILITY_ENABLE='maybe' is invalid"),
        ({"BIDKV_UTILITY_KILL_SWITCH": "2"}, "BIDKV_UTILITY_KILL_SWITCH='2' is invalid"),
        ({"BIDKV_UTILITY_LIVENESS_PREEMPTIONS": "x"}, "BIDKV_UTILITY_LIVENESS_PREEMPTIONS='x'"),
        ({"BIDKV_UTILITY_LIVENESS_PREEMPTIONS": "-1"}, "greater than or equal to 0"),
        ({"BIDKV_UTILITY_CASCADE_GAIN_RATIO": "0.5"}, "BIDKV_UTILITY_CASCADE_GAIN_RATIO='0.5'"),
        ({"BIDKV_UTILITY_CASCADE_GAIN_RATIO": "abc"}, "valid number"),
        ({"BIDKV_UTILITY_PREEMPT_WEIGHT": "-0.1"}, "BIDKV_UTILITY_PREEMPT_WEIGHT"),
        ({"BIDKV_UTILITY_STRATEGY": "pe"}, "unknown strategy; accepted: bidkv, builtin"),
        ({"BIDKV_UTILITY_KV_GATE": "0.9"}, "BIDKV_UTILITY_KV_GATE is not a BidKV setting"),
        # Infinite or huge weights would zero every utility at the first decision.
        ({"BIDKV_UTILITY_BASE_COST": "inf"}, "BIDKV_UTILITY_BASE_COST='inf' is invalid"),
        ({"BIDKV_UTILITY_RECOMPUTE_WEIGHT": "nan"}, "BIDKV_UTILITY_RECOMPUTE_WEIGHT='nan'"),
        ({"BIDKV_UTILITY_PREEMPT_WEIGHT": "1e307"}, "less than or equal to 1000000"),
        ({"BIDKV_UTILITY_EPSILON": "inf"}, "BIDKV_UTILITY_EPSILON='inf' is invalid"),
    ],
)
def test_invalid_environment_fails_with_one_line(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        BidKVConfig.from_sources(None, env)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message
    assert isinstance(info.value, ValueError)


def test_invalid_additional_config_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"additional_config\['bidkv'\]\['seed'\]='x'"):
        BidKVConfig.from_sources({"bidkv": {"seed": "x"}}, {})
    with pytest.raises(ConfigError, match=r"additional_config\['bidkv'\]\['nope'\] is not"):
        BidKVConfig.from_sources({"bidkv": {"nope": 1}}, {})
    with pytest.raises(ConfigError, match="must be a JSON object"):
        BidKVConfig.from_sources({"bidkv": [1]}, {})
    # A Python dict (LLM(additional_config=...)) may carry a key JSON never could.
    with pytest.raises(ConfigError, match=r"additional_config\['bidkv'\]\[1\] is not a BidKV"):
        BidKVConfig.from_sources({"bidkv": {1: 2}}, {})


def test_reference_top_level_keys_are_read_or_refused() -> None:
    """The reference BidKV's top-level additional_config keys: a bad value names its key
    (the reference's own integration test), a known key sets its field under
    additional_config["bidkv"], and a reference knob this policy lacks is refused rather
    than silently ignored. Other components' keys stay ignored."""
    with pytest.raises(ConfigError, match=r"additional_config\['utility_completion_weight'\]"):
        BidKVConfig.from_sources({"utility_completion_weight": -1.0}, {})
    config = BidKVConfig.from_sources(
        {"enable_utility_victim_selection": True, "utility_liveness_preemptions": 3,
         "preemption_policy": "x.Y", "_manager_runtime_qualification": {"a": 1}},
        {"BIDKV_UTILITY_LIVENESS_PREEMPTIONS": "1"},
    )
    assert config.is_active and config.liveness_preemptions == 3
    wins = BidKVConfig.from_sources(
        {"utility_liveness_preemptions": 3, "bidkv": {"liveness_preemptions": 5}}, {}
    )
    assert wins.liveness_preemptions == 5
    with pytest.raises(ConfigError, match=r"'utility_kv_gate'\] is a reference BidKV setting"):
        BidKVConfig.from_sources({"utility_kv_gate": 0.9}, {})


def test_string_false_means_false() -> None:
    """The reference parsed additional_config booleans with bool(), so "false" meant True."""
    assert not BidKVConfig.from_sources({"bidkv": {"enabled": "false"}}, {}).enabled
    assert BidKVConfig.from_sources({"bidkv": {"enabled": True}}, {}).enabled


def test_from_vllm_config_reads_additional_config_env_and_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Cache:
        block_size = 32
        enable_prefix_caching = False

    class Vllm:
        additional_config: ClassVar[dict[str, Any]] = {"bidkv": {"strategy": "largest-first"}}
        cache_config = Cache()

    monkeypatch.setenv("BIDKV_UTILITY_ENABLE", "1")
    policy = BidkvPreemptionPolicy.from_vllm_config(Vllm())
    assert policy.config.is_active
    assert policy.config.strategy == "largest-first"
    assert (policy.config.block_size, policy.config.prefix_caching) == (32, False)
    monkeypatch.setenv("BIDKV_UTILITY_CASCADE_GAIN_RATIO", "0")
    with pytest.raises(ValueError, match="BIDKV_UTILITY_CASCADE_GAIN_RATIO"):
        BidkvPreemptionPolicy.from_vllm_config(Vllm())


@pytest.mark.parametrize(
    ("source", "name", "raw"),
    [
        ("env", "BIDKV_UTILITY_BLOCK_SIZE", "abc"),
        ("env", "BIDKV_UTILITY_PREFIX_CACHING", "maybe"),
        ("section", "block_size", "xyz"),
        ("section", "prefix_caching", -1),
    ],
)
def test_engine_facts_do_not_hide_a_malformed_setting(
    monkeypatch: pytest.MonkeyPatch, source: str, name: str, raw: object
) -> None:
    """The engine's block size and prefix-caching flag replace the configured ones, but a
    malformed configured value still fails start-up with a line naming it: an operator's
    typo must not pass silently because a real engine happens to supply the fact."""

    class Cache:
        block_size = 16
        enable_prefix_caching = True

    class Vllm:
        additional_config: ClassVar[dict[str, Any]] = {}
        cache_config = Cache()

    monkeypatch.setenv("BIDKV_UTILITY_ENABLE", "1")
    if source == "env":
        monkeypatch.setenv(name, str(raw))
    else:
        Vllm.additional_config = {"bidkv": {name: raw}}
    with pytest.raises(ConfigError, match=name) as caught:
        BidkvPreemptionPolicy.from_vllm_config(Vllm())
    assert "\n" not in str(caught.value)
    # A well-formed value is replaced by the engine's, as README says.
    monkeypatch.setenv("BIDKV_UTILITY_BLOCK_SIZE", "32")
    monkeypatch.setenv("BIDKV_UTILITY_PREFIX_CACHING", "0")
    Vllm.additional_config = {}
    policy = BidkvPreemptionPolicy.from_vllm_config(Vllm())
    assert (policy.config.block_size, policy.config.prefix_caching) == (16, True)


@pytest.mark.parametrize(
    ("environ", "additional", "named"),
    [
        ({"BIDKV_UTILITY_ENABLE": "maybe"}, {"bidkv": {"enabled": True}},
         "BIDKV_UTILITY_ENABLE='maybe' is invalid"),
        ({}, {"utility_completion_weight": -1, "bidkv": {"completion_weight": 1.0}},
         "additional_config['utility_completion_weight']=-1 is invalid"),
        ({"BIDKV_UTILITY_SEED": "abc"}, {"bidkv": {"seed": 3}},
         "BIDKV_UTILITY_SEED='abc' is invalid"),
    ],
)
def test_a_malformed_value_a_later_source_replaces_is_refused(
    environ: dict[str, str], additional: dict[str, Any], named: str
) -> None:
    """Precedence (environment, reference keys, ``additional_config["bidkv"]``) picks among
    well-formed values; a malformed one fails naming its own source even when a later
    source replaces it, as an unknown name does."""
    with pytest.raises(ConfigError) as caught:
        BidKVConfig.from_sources(additional, environ)
    assert str(caught.value).startswith(named), str(caught.value)
    fixed = {k: "1" if k.endswith(("ENABLE", "SEED")) else v for k, v in environ.items()}
    clean = {k: v for k, v in additional.items() if k != "utility_completion_weight"}
    BidKVConfig.from_sources(clean, fixed)  # the well-formed pair is accepted


@pytest.mark.parametrize(
    ("budget", "long_prefill", "chunk", "victim"),
    [(256, 0, 256, "A"), (8192, 256, 256, "A"), (8192, 0, 8192, "B")],
)
def test_the_prefill_chunk_is_the_engines_token_budget(
    monkeypatch: pytest.MonkeyPatch, budget: int, long_prefill: int, chunk: int, victim: str
) -> None:
    """Without host facts a prefilling requester needs one prefill chunk's worth of blocks;
    a step prefills at most the scheduler's ``max_num_batched_tokens`` of one request (and
    at most ``long_prefill_token_threshold`` when it is set), so that is the chunk. With a
    256-token budget the requester needs 16 blocks, which the small candidate A frees at
    less recompute than B; with 8192 it needs 63, which only B frees (sufficiency first).
    A fixed 2,048-token chunk chose B in all three engines."""

    class Cache:
        block_size = 16
        enable_prefix_caching = False

    class Scheduler:
        max_num_batched_tokens = budget
        long_prefill_token_threshold = long_prefill

    class Vllm:
        additional_config: ClassVar[dict[str, Any]] = {"bidkv": {"enabled": True}}
        cache_config = Cache()
        scheduler_config = Scheduler()

    monkeypatch.setenv("BIDKV_UTILITY_PREFILL_CHUNK_TOKENS", "2048")  # the engine's wins
    policy = BidkvPreemptionPolicy.from_vllm_config(Vllm())
    assert policy.config.prefill_chunk_tokens == chunk
    small = cand("A", computed=300, prompt=300, output=10)  # 19 blocks
    large = cand("B", computed=1100, prompt=1100, output=10)  # 69 blocks
    requester = cand("R", computed=0, prompt=1000)  # 1,000 prompt tokens still to prefill
    context = ctx([small, large, requester], requester="R", builtin="R")
    assert policy.select_victim(context) == victim


def test_a_real_engine_config_gives_its_token_budget_as_the_chunk() -> None:
    from bidkv_ext.hosts.vllm.offline import build_vllm_config

    vllm_config, _ = build_vllm_config(num_gpu_blocks=64, max_num_batched_tokens=512)
    policy = BidkvPreemptionPolicy.from_vllm_config(vllm_config)
    assert policy.config.prefill_chunk_tokens == 512


def test_from_vllm_config_ignores_values_that_are_not_engine_facts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A non-mapping ``additional_config`` is no configuration, and a block size that is not
    a positive integer or a prefix-caching flag that is not a boolean is no engine fact:
    the environment's settings stay in force instead of the load failing."""

    class Cache:
        block_size: object = 0
        enable_prefix_caching: object = None

    class Vllm:
        additional_config: object = "not a mapping"
        cache_config = Cache()

    monkeypatch.setenv("BIDKV_UTILITY_ENABLE", "1")
    monkeypatch.setenv("BIDKV_UTILITY_BLOCK_SIZE", "32")
    monkeypatch.setenv("BIDKV_UTILITY_PREFIX_CACHING", "0")
    for block_size in (0, -16, "16", 16.0, None):
        Cache.block_size = block_size
        policy = BidkvPreemptionPolicy.from_vllm_config(Vllm())
        assert policy.config.is_active
        assert (policy.config.block_size, policy.config.prefix_caching) == (32, False)
    Cache.block_size, Cache.enable_prefix_caching = 64, True
    policy = BidkvPreemptionPolicy.from_vllm_config(Vllm())
    assert (policy.config.block_size, policy.config.prefix_caching) == (64, True)


def test_no_argument_constructor_reads_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIDKV_UTILITY_ENABLE", "1")
    monkeypatch.setenv("BIDKV_UTILITY_STRATEGY", "static-random")
    policy = BidkvPreemptionPolicy()
    assert policy.config.is_active and policy.strategy.name == "static-random"


def test_empty_environment_boolean_means_false() -> None:
    """An empty boolean variable (``BIDKV_UTILITY_ENABLE=``, as a shell leaves an unset
    value) reads as false, not as an error."""
    config = BidKVConfig.from_sources(None, {"BIDKV_UTILITY_ENABLE": ""})
    assert config.enabled is False and not config.is_active
    assert BidKVConfig.from_sources(None, {"BIDKV_UTILITY_KILL_SWITCH": ""}).kill_switch is False


def test_every_reference_setting_maps_to_its_own_field() -> None:
    """README: the reference BidKV's settings are read as the same settings, its gating and
    snapshot knobs are refused (reference-lessons.md section 5 lists them). Each reference
    top-level ``additional_config`` key sets exactly its counterpart (a distinct value per
    key, so a key read into the wrong field shows), and its kill switch wins over its
    enable flag; each reference environment variable is accepted the same way, and each
    reference knob without a counterpart is refused under both spellings."""
    reference = {
        "enable_utility_victim_selection": True,
        "utility_strategy": "static-random",
        "utility_completion_weight": 0.5,
        "utility_preempt_weight": 0.3,
        "utility_liveness_preemptions": 2,
        "utility_cascade_gain_ratio": 1.5,
        "utility_epsilon": 1e-6,
        "utility_default_max_tokens": 256,
    }
    config = BidKVConfig.from_sources(reference, {})
    assert config.is_active and not config.kill_switch
    assert (config.strategy, config.completion_weight, config.preempt_weight) == (
        "static-random", 0.5, 0.3)
    assert (config.liveness_preemptions, config.cascade_gain_ratio) == (2, 1.5)
    assert (config.epsilon, config.default_max_tokens) == (1e-6, 256)
    killed = BidKVConfig.from_sources({**reference, "utility_kill_switch": True}, {})
    assert killed.kill_switch and killed.enabled and not killed.is_active
    environ = {
        "BIDKV_UTILITY_ENABLE": "1", "BIDKV_UTILITY_STRATEGY": "static-random",
        "BIDKV_UTILITY_COMPLETION_WEIGHT": "0.5", "BIDKV_UTILITY_PREEMPT_WEIGHT": "0.3",
        "BIDKV_UTILITY_LIVENESS_PREEMPTIONS": "2", "BIDKV_UTILITY_CASCADE_GAIN_RATIO": "1.5",
        "BIDKV_UTILITY_EPSILON": "1e-6", "BIDKV_UTILITY_DEFAULT_MAX_TOKENS": "256",
    }
    assert BidKVConfig.from_sources(None, environ) == config
    assert not BidKVConfig.from_sources(
        None, {**environ, "BIDKV_UTILITY_KILL_SWITCH": "1"}).is_active
    for knob in ("kv_gate", "cooldown_s", "min_running", "snapshot_enabled",
                 "snapshot_top_k", "snapshot_history_size"):
        with pytest.raises(ConfigError, match="is a reference BidKV setting this policy"):
            BidKVConfig.from_sources({f"utility_{knob}": 1}, {})
        with pytest.raises(ConfigError, match="is not a BidKV setting"):
            BidKVConfig.from_sources(None, {f"BIDKV_UTILITY_{knob.upper()}": "1"})


NUMERIC_FIELDS = [
    name for name, field in BidKVConfig.model_fields.items() if field.annotation in (int, float)
]


@pytest.mark.parametrize("name", NUMERIC_FIELDS)
@pytest.mark.parametrize("flag", [True, False])
def test_a_boolean_given_for_a_number_is_refused(name: str, flag: bool) -> None:
    """JSON ``true`` in a numeric key was read as 1 (pydantic's lax mode): a flag written
    under the wrong key ran with a made-up number. Every numeric setting, including ones
    added later, refuses it, from the section and from the reference's top-level keys."""
    with pytest.raises(ConfigError) as caught:
        BidKVConfig.from_sources({"bidkv": {name: flag}})
    message = str(caught.value)
    assert message.startswith(f"additional_config['bidkv'][{name!r}]={flag!r} is invalid")
    assert "expected a number, not a boolean" in message
    assert "\n" not in message
    for key, field in REFERENCE_KEYS.items():
        if field == name:
            with pytest.raises(ConfigError, match=f"additional_config\\[{key!r}\\]"):
                BidKVConfig.from_sources({key: flag})


def test_numbers_still_read_from_json_and_environment() -> None:
    config = BidKVConfig.from_sources(
        {"bidkv": {"liveness_preemptions": 3, "base_cost": 2}},
        environ={"BIDKV_UTILITY_EPSILON": "0.5", "BIDKV_UTILITY_SEED": "7"},
    )
    assert (config.liveness_preemptions, config.base_cost) == (3, 2.0)
    assert (config.epsilon, config.seed) == (0.5, 7)
