"""Draft tokens, drafter lookahead and encoder inputs through the adapter's victim rollback.

When the policy picks a victim that was already scheduled earlier in the same step, the
rewritten ``Scheduler.schedule`` runs vLLM's own PRIORITY removal body unconditionally. Besides
the token budget and new blocks (tests/test_host_adapter.py), that body must also roll back
what speculative decoding and multimodal inputs added for the victim. Against the real vLLM
0.33.0 scheduler and KV-cache manager on CPU (no weights, nothing downloaded), this file
guards that:

1. the victim's ``scheduled_spec_decode_tokens`` entry is removed, and the draft slots it
   charged to the input budget (``input_budget += restored + draft_slots``) come back, so
   the requests after it are scheduled exactly as if the victim had never been;
2. its ``scheduled_encoder_inputs`` entry is removed and the encoder compute budget it used
   is restored, so a later request's image can still be encoded in the same step;
3. the optional host fact ``needed_blocks`` counts the KV slots vLLM reserves past the
   scheduled tokens for the drafter (``num_lookahead_tokens``), as ``allocate_slots`` does,
   and, as it does, none past ``max_model_len``;

and that, with a policy that abstains, spec-decode runs under priority scheduling (where the
stock victim is often already scheduled) match unmodified vLLM step by step, draft tokens
included.

Speculative decoding is configured the way vLLM itself accepts it without a model: method
``ngram`` (no drafter, no lookahead, no draft slots) or ``draft_model`` pointing at the bundled
tiny config (lookahead ``k`` and one draft slot per request); draft tokens reach requests
through ``Scheduler.update_draft_token_ids``, as from a model runner. The encoder case uses a
hand-written tiny config of a real vLLM multimodal architecture (BAGEL, whose maximum image
size vLLM derives from the config alone) plus a word-level tokenizer built locally, so vLLM's
own ``MultiModalBudget`` sets the encoder budget.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bidkv_ext.contract import PreemptionContext, PreemptionContextFacts
from tests.conftest import seeded_workload

BLOCK = 16
SHARED = list(range(100, 132))  # two full blocks shared by requests "0" and "1"


# --- construction -----------------------------------------------------------------------


def spec_scheduler(
    offline: ModuleType,
    *,
    method: str,
    num_speculative_tokens: int,
    num_gpu_blocks: int,
    scheduler_cls: type | None = None,
    preemption_policy: object = None,
    **config_kwargs: Any,
) -> Any:
    """A real scheduler whose ``VllmConfig`` carries a ``SpeculativeConfig``.

    ``method="ngram"`` needs no drafter; ``method="draft_model"`` uses the bundled tiny
    config (:data:`offline.MODEL_DIR`) as the draft model's config, so vLLM reserves
    ``num_speculative_tokens`` lookahead slots and one draft slot per request.
    """
    from vllm.config import SpeculativeConfig, VllmConfig

    base, kv_cache_config = offline.build_vllm_config(
        num_gpu_blocks=num_gpu_blocks, **config_kwargs
    )
    speculative_config = SpeculativeConfig(
        method=method,  # type: ignore[arg-type]  # validated by vLLM
        model=None if method == "ngram" else str(offline.MODEL_DIR),
        num_speculative_tokens=num_speculative_tokens,
        target_model_config=base.model_config,
        target_parallel_config=base.parallel_config,
    )
    vllm_config = VllmConfig(
        model_config=base.model_config,
        scheduler_config=base.scheduler_config,
        cache_config=base.cache_config,
        speculative_config=speculative_config,
        additional_config=base.additional_config,
    )
    return offline.build_scheduler(
        vllm_config,
        kv_cache_config,
        scheduler_cls=scheduler_cls,
        preemption_policy=preemption_policy,
    )


def propose(scheduler: Any, drafts: dict[str, list[int]]) -> None:
    """Hand draft tokens to the scheduler as a model runner's drafter does."""
    from vllm.v1.outputs import DraftTokenIds

    scheduler.update_draft_token_ids(DraftTokenIds(list(drafts), list(drafts.values())))


def _step(offline: ModuleType, scheduler: Any) -> Any:
    out = scheduler.schedule()
    scheduler.update_from_output(out, offline.runner_output_for(out, scheduler))
    return out


class Choose:
    """Picks a fixed request (``None``: abstains, so vLLM's own victim is taken)."""

    def __init__(self, choose: str | None) -> None:
        self.choose = choose
        self.contexts: list[PreemptionContext] = []

    def select_victim(self, context: PreemptionContext) -> str | None:
        self.contexts.append(context)
        return self.choose


def _pressured_spec(
    offline: ModuleType, *, method: str, k: int, own_tokens: int, policy: object
) -> Any:
    """Three decoding requests holding 7 of 8 usable blocks, each with ``k`` drafts.

    "0" and "1" share SHARED (2 blocks) plus ``own_tokens`` own prompt tokens; "2" has
    ``32 + own_tokens`` unshared ones. In the next step "0" takes the last free block and
    "1" then fails to allocate, with "0" already scheduled.
    """
    scheduler = spec_scheduler(
        offline,
        method=method,
        num_speculative_tokens=k,
        num_gpu_blocks=9,
        preemption_policy=policy,
    )
    prompts = [
        SHARED + [1000 + i for i in range(own_tokens)],
        SHARED + [2000 + i for i in range(own_tokens)],
        [3000 + i for i in range(32 + own_tokens)],
    ]
    for i, prompt in enumerate(prompts):
        scheduler.add_request(offline.make_request(str(i), prompt, 40, 10.0 + i))
    first = _step(offline, scheduler)
    assert list(first.num_scheduled_tokens) == ["0", "1", "2"]
    assert offline.free_blocks(scheduler) == 1
    propose(scheduler, {rid: [(int(rid) + 1) * 10 + j + 1 for j in range(k)] for rid in "012"})
    return scheduler


# --- 1. draft tokens and draft slots of a scheduled victim ---------------------------------


def test_scheduled_victim_loses_its_draft_tokens(vllm_offline: ModuleType) -> None:
    """The victim's drafts must leave ``scheduled_spec_decode_tokens`` with its tokens:
    a leftover entry would have the model runner verify drafts for a request that is not
    in the batch (and whose blocks are already back in the pool)."""
    policy = Choose("0")  # "0" is already scheduled when "1" fails to allocate
    scheduler = _pressured_spec(vllm_offline, method="ngram", k=2, own_tokens=16, policy=policy)
    assert (scheduler.num_spec_tokens, scheduler.num_lookahead_tokens) == (2, 0)

    out = scheduler.schedule()

    assert len(policy.contexts) == 1 and policy.contexts[0].requesting_request_id == "1"
    assert out.preempted_req_ids == {"0"}
    assert out.num_scheduled_tokens == {"1": 3, "2": 3}  # 1 + 2 drafts each
    assert out.scheduled_spec_decode_tokens == {"1": [21, 22], "2": [31, 32]}
    assert set(out.scheduled_spec_decode_tokens) <= set(out.num_scheduled_tokens)
    victim = scheduler.requests["0"]
    assert victim.status.name == "PREEMPTED" and victim.spec_token_ids == []
    assert scheduler.waiting.peek_request() is victim
    # The step is consistent for the host too: outputs apply, the run completes and
    # every block comes back.
    scheduler.update_from_output(out, vllm_offline.runner_output_for(out, scheduler))
    vllm_offline.run_to_completion(scheduler)
    assert vllm_offline.free_blocks(scheduler) == 8


def test_scheduled_victim_gives_back_its_draft_slots(vllm_offline: ModuleType) -> None:
    """With a draft model every scheduled request charges ``1 + k`` tokens plus one draft
    slot to the input budget. With a budget of 10 and ``k = 3``, "2" gets all its
    ``1 + 3`` tokens only if the victim's 4 tokens *and* its draft slot came back
    (without the slot "2" would be cut to 3 tokens and lose a draft)."""
    policy = Choose("0")
    # 42-token prompts: the prefill reserves ceil((42 + 3) / 16) = 3 blocks, a decode with
    # 3 drafts needs ceil((42 + 4 + 3) / 16) = 4.
    scheduler = _pressured_spec(
        vllm_offline, method="draft_model", k=3, own_tokens=10, policy=policy
    )
    assert (scheduler.num_spec_tokens, scheduler.num_lookahead_tokens) == (3, 3)
    assert scheduler.vllm_config.speculative_config.max_num_new_slots_for_drafting == 1

    batched = scheduler.scheduler_config.max_num_batched_tokens
    scheduler.scheduler_config.max_num_batched_tokens = 10
    out = scheduler.schedule()
    scheduler.scheduler_config.max_num_batched_tokens = batched

    assert len(policy.contexts) == 1
    assert out.preempted_req_ids == {"0"}
    assert out.num_scheduled_tokens == {"1": 4, "2": 4}
    assert out.scheduled_spec_decode_tokens == {"1": [21, 22, 23], "2": [31, 32, 33]}
    scheduler.update_from_output(out, vllm_offline.runner_output_for(out, scheduler))
    vllm_offline.run_to_completion(scheduler)
    assert vllm_offline.free_blocks(scheduler) == 8


# --- 3. drafter lookahead in the host fact "needed_blocks" ---------------------------------


class FactsPolicy:
    """Asks for host facts and abstains, so vLLM's own victim is taken."""

    wants_host_facts = True

    def __init__(self) -> None:
        self.facts: list[PreemptionContextFacts | None] = []

    def select_victim(self, context: PreemptionContext) -> str | None:
        raise AssertionError("the host must call select_victim_with_facts")

    def select_victim_with_facts(
        self, context: PreemptionContext, facts: PreemptionContextFacts | None
    ) -> str | None:
        self.facts.append(facts)
        return None


def test_needed_blocks_counts_the_drafter_lookahead(vllm_offline: ModuleType) -> None:
    """``allocate_slots`` reserves ``num_lookahead_tokens`` slots past the scheduled
    tokens for the drafter; the fact must count them too, or it tells the policy that a
    requester whose allocation just failed needs no block at all.

    "1" holds 3 blocks (42 computed tokens) and asks for 1 + 3 drafts: 46 tokens fit its
    3 blocks, but with the 3 lookahead slots it needs 49, i.e. a 4th block, and none is
    free after "0" took the last one.
    """
    policy = FactsPolicy()
    scheduler = _pressured_spec(
        vllm_offline, method="draft_model", k=3, own_tokens=10, policy=policy
    )
    out = scheduler.schedule()

    assert len(policy.facts) == 1
    facts = policy.facts[0]
    assert facts is not None and facts.block_size == BLOCK
    assert facts.facts["1"].total_blocks == 3
    assert facts.needed_blocks == 1
    # The stock victim (the tail, "2") was preempted and "1" got exactly that one block.
    assert out.preempted_req_ids == {"2"}
    cached = out.scheduled_cached_reqs
    new_blocks = dict(zip(cached.req_ids, cached.new_block_ids, strict=True))
    assert new_blocks["1"] is not None and len(new_blocks["1"][0]) == facts.needed_blocks


class FactsChoosing(FactsPolicy):
    """Asks for host facts and picks a fixed request."""

    def __init__(self, choose: str) -> None:
        super().__init__()
        self.choose = choose

    def select_victim_with_facts(
        self, context: PreemptionContext, facts: PreemptionContextFacts | None
    ) -> str | None:
        super().select_victim_with_facts(context, facts)
        return self.choose


def test_needed_blocks_stops_at_max_model_len(vllm_offline: ModuleType) -> None:
    """Near ``max_model_len`` the drafter's lookahead is cut: ``allocate_slots`` reserves
    ``min(computed + new + lookahead, max_model_len)`` slots, and so must the fact.

    ``max_model_len`` 64, ``k = 3``. "R" (63-token prompt) holds 3 blocks after a first
    45-token chunk; its last 18 tokens need 63 + 3 lookahead = 66 slots, capped at 64:
    4 blocks, one more than it holds (uncapped it would be 5, two more). "V" took the last
    free block earlier in the step; the policy picks it, and vLLM then gives "R" exactly
    the one block the fact names.
    """
    policy = FactsChoosing("V")
    scheduler = spec_scheduler(
        vllm_offline,
        method="draft_model",
        num_speculative_tokens=3,
        num_gpu_blocks=8,
        preemption_policy=policy,
        max_model_len=64,
    )
    assert (scheduler.num_lookahead_tokens, scheduler.max_model_len) == (3, 64)
    scheduler.add_request(vllm_offline.make_request("V", list(range(10, 54)), 20, 1.0))
    assert _step(vllm_offline, scheduler).num_scheduled_tokens == {"V": 44}
    scheduler.add_request(vllm_offline.make_request("R", list(range(100, 163)), 1, 2.0))
    budget = scheduler.max_num_scheduled_tokens
    scheduler.max_num_scheduled_tokens = 46  # "V" decodes 1 token, "R" prefills 45
    assert _step(vllm_offline, scheduler).num_scheduled_tokens == {"V": 1, "R": 45}
    scheduler.max_num_scheduled_tokens = budget
    assert vllm_offline.free_blocks(scheduler) == 1

    out = scheduler.schedule()

    assert len(policy.facts) == 1
    facts = policy.facts[0]
    assert facts is not None and facts.facts["R"].total_blocks == 3
    assert out.preempted_req_ids == {"V"}
    assert out.num_scheduled_tokens == {"R": 18}
    cached = out.scheduled_cached_reqs
    new_blocks = dict(zip(cached.req_ids, cached.new_block_ids, strict=True))
    assert len(new_blocks["R"][0]) == 1
    assert facts.needed_blocks == 1


# --- stock equivalence under priority scheduling --------------------------------------------


NUM_SPEC = 3


def _deterministic_acceptance(req_id: str, request: Any, drafts: list[int]) -> int:
    # Varies by request and length, so rejections roll positions back too.
    return (int(req_id[1:]) + request.num_output_tokens) % (len(drafts) + 1)


def runner_output_with_drafts(
    offline: ModuleType,
    out: Any,
    scheduler: Any,
    accept: Callable[[str, Any, list[int]], int] = _deterministic_acceptance,
) -> Any:
    """One sampled token per completed position plus ``accept(req_id, request, drafts)``
    of the request's scheduled drafts (by default a deterministic number)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        if request.num_computed_tokens < request.num_tokens:
            sampled.append([])  # a non-final prefill chunk samples nothing
            continue
        drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
        accepted = accept(req_id, request, drafts)
        sampled.append([offline.FAKE_TOKEN_ID] * (1 + accepted))
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def _drive_with_drafts(
    offline: ModuleType, scheduler: Any, workload: list[tuple[str, list[int], int, float, int]]
) -> tuple[list[object], int]:
    """Two arrivals per step; after each step every running request gets NUM_SPEC drafts.

    Returns per step the schedule digest, the scheduled draft tokens and the free blocks,
    and the total number of preemptions.
    """
    pending = list(workload)
    requests = []
    steps: list[object] = []
    while pending or scheduler.has_unfinished_requests():
        for _ in range(min(2, len(pending))):
            rid, prompt, max_tokens, arrival, priority = pending.pop(0)
            request = offline.make_request(rid, prompt, max_tokens, arrival, priority)
            requests.append(request)
            scheduler.add_request(request)
        out = scheduler.schedule()
        drafts = tuple(sorted((k, tuple(v)) for k, v in out.scheduled_spec_decode_tokens.items()))
        steps.append((offline.schedule_digest(out), drafts, offline.free_blocks(scheduler)))
        scheduler.update_from_output(out, runner_output_with_drafts(offline, out, scheduler))
        propose(
            scheduler, {r.request_id: [offline.FAKE_TOKEN_ID] * NUM_SPEC for r in scheduler.running}
        )
        assert len(steps) < 20_000, "workload did not finish"
    return steps, sum(r.num_preemptions for r in requests)


class AbstainCountingScheduledVictims:
    """Abstains; counts decisions whose stock victim precedes the requester in ``running``
    (scheduled earlier in the step, so its rollback runs)."""

    def __init__(self) -> None:
        self.calls = 0
        self.scheduled_victims = 0

    def select_victim(self, context: PreemptionContext) -> str | None:
        self.calls += 1
        ids = [c.request_id for c in context.candidates]
        if ids.index(context.builtin_victim_id) < ids.index(context.requesting_request_id):
            self.scheduled_victims += 1
        return None


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_priority_spec_decode_run_matches_stock(vllm_offline: ModuleType, method: str) -> None:
    """Under PRIORITY the stock victim is often a request scheduled earlier in the step;
    with an abstaining policy the adapter's rollback of it (tokens, draft slots, draft
    tokens, blocks) must leave every step exactly as unmodified vLLM's."""
    from vllm.v1.core.sched.scheduler import Scheduler

    config = {"max_num_seqs": 24, "max_num_batched_tokens": 256, "max_model_len": 1024}
    workload = seeded_workload(1234, 240)

    def run(cls: type | None, policy: object) -> tuple[list[object], int]:
        scheduler = spec_scheduler(
            vllm_offline,
            method=method,
            num_speculative_tokens=NUM_SPEC,
            num_gpu_blocks=40,
            scheduler_cls=cls,
            preemption_policy=policy,
            policy="priority",
            **config,
        )
        return _drive_with_drafts(vllm_offline, scheduler, workload)

    expected, stock_preemptions = run(Scheduler, None)
    policy = AbstainCountingScheduledVictims()
    actual, preemptions = run(None, policy)

    assert stock_preemptions > 50, "workload must put the KV cache under pressure"
    assert policy.scheduled_victims > 0, "no stock victim was already scheduled"
    assert preemptions == stock_preemptions and policy.calls == preemptions
    assert len(actual) == len(expected)
    for step, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert got == want, f"step {step} differs from stock vLLM"


# --- 2. encoder inputs of a scheduled victim ------------------------------------------------


IMAGE_OFFSET = 16
IMAGE_LENGTH = 32  # encoder embeddings of one image; the model allows up to 6 * 6 = 36


@pytest.fixture(scope="module")
def bagel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BAGEL model directory: config (no weights) and a word-level tokenizer.

    vLLM builds the multimodal processor (which requires a tokenizer) and derives the
    largest image from ``vit_max_num_patch_per_side`` alone, so nothing is downloaded.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("bagel")
    config = {
        "architectures": ["BagelForConditionalGeneration"],
        "model_type": "bagel",
        "torch_dtype": "float16",
        "vit_max_num_patch_per_side": 6,
        "llm_config": {
            "model_type": "qwen2",
            "vocab_size": 32000,
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 4096,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        "vit_config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 84,
            "patch_size": 14,
        },
    }
    (root / "config.json").write_text(json.dumps(config))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(root / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
    }
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return root


def _multimodal_scheduler(
    offline: ModuleType, model_dir: Path, *, num_gpu_blocks: int, preemption_policy: object
) -> Any:
    """``PolicyScheduler`` for the BAGEL config: 48 tokens per step, prefill chunks of 16,
    admission by first chunk (``scheduler_reserve_full_isl=False``), so KV runs out on a
    chunk boundary."""
    import dataclasses

    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    base, kv_cache_config = offline.build_vllm_config(
        num_gpu_blocks=num_gpu_blocks,
        block_size=BLOCK,
        max_num_seqs=8,
        max_num_batched_tokens=48,
        max_model_len=1024,
    )
    model_config = ModelConfig(model=str(model_dir), dtype="float16", seed=42, max_model_len=1024)
    scheduler_config = dataclasses.replace(
        base.scheduler_config,
        long_prefill_token_threshold=16,
        scheduler_reserve_full_isl=False,
        max_model_len=1024,  # init-only fields must be given again
        is_encoder_decoder=model_config.is_encoder_decoder,
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=base.cache_config,
    )
    register_all_kvcache_specs(vllm_config)  # type: ignore[no-untyped-call]
    return offline.build_scheduler(
        vllm_config, kv_cache_config, preemption_policy=preemption_policy
    )


def _image_request(offline: ModuleType, request_id: str, base: int, arrival: float) -> Any:
    """16 text tokens, then one image of IMAGE_LENGTH placeholder tokens (what the input
    processor hands the engine: the prompt ids and one ``MultiModalFeatureSpec``)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(ignore_eos=True, max_tokens=4)
    params.update_from_generation_config({}, offline.EOS_TOKEN_ID)
    feature = MultiModalFeatureSpec(
        data=None,  # as for an item the engine already has cached: no pixels needed
        modality="image",
        identifier=f"image-{request_id}",
        mm_position=PlaceholderRange(offset=IMAGE_OFFSET, length=IMAGE_LENGTH),
    )
    prompt = [base + i for i in range(IMAGE_OFFSET)] + [base + 500] * IMAGE_LENGTH
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        mm_features=[feature],
        block_hasher=offline._hasher(BLOCK),
        arrival_time=arrival,
    )


def test_scheduled_victim_gives_back_encoder_inputs_and_budget(
    vllm_offline: ModuleType, bagel_dir: Path
) -> None:
    """The victim's image must leave ``scheduled_encoder_inputs`` (else the runner encodes
    it for a request not in the batch) and its embeddings must return to the encoder
    compute budget: the budget (48) holds one 32-embedding image per step, so "2"'s image
    chunk is scheduled only if "0"'s image was given back.

    Step 1 prefills the 16 text tokens of "0", "1" (text only) and "2" into 3 of 4 usable
    blocks. In step 2 "0"'s chunk covers its image and takes the last block, "1"'s first
    decode token needs a block, and the policy picks "0", already scheduled.
    """
    policy = Choose("0")
    scheduler = _multimodal_scheduler(
        vllm_offline, bagel_dir, num_gpu_blocks=5, preemption_policy=policy
    )
    assert scheduler.max_num_encoder_input_tokens == 48
    cache_size = scheduler.encoder_cache_manager.cache_size
    scheduler.add_request(_image_request(vllm_offline, "0", 1000, 10.0))
    scheduler.add_request(vllm_offline.make_request("1", list(range(2000, 2016)), 4, 11.0))
    scheduler.add_request(_image_request(vllm_offline, "2", 3000, 12.0))
    first = _step(vllm_offline, scheduler)
    assert first.num_scheduled_tokens == {"0": 16, "1": 16, "2": 16}
    assert first.scheduled_encoder_inputs == {}
    assert vllm_offline.free_blocks(scheduler) == 1

    out = scheduler.schedule()

    assert len(policy.contexts) == 1 and policy.contexts[0].requesting_request_id == "1"
    assert out.preempted_req_ids == {"0"}
    assert out.scheduled_encoder_inputs == {"2": [0]}
    assert out.num_scheduled_tokens == {"1": 1, "2": 16}
    # Only "2"'s image holds encoder cache space: "0"'s allocation went with it.
    assert scheduler.encoder_cache_manager.num_free_slots == cache_size - IMAGE_LENGTH
    scheduler.update_from_output(out, vllm_offline.runner_output_for(out, scheduler))
    vllm_offline.run_to_completion(scheduler)
    assert vllm_offline.free_blocks(scheduler) == 4
