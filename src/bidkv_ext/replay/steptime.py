"""The step-time model: what one scheduler step costs on the GPU the replay stands in for.

Formula (evaluation.md section 1), one value per scheduler step::

    t_step = a + b * prefill_tokens + c * decode_requests + d * decode_context_tokens

``prefill_tokens``
    Token positions scheduled this step for requests that are not in single-token decode
    (new prompts, prompt chunks, and recompute after preemption).
``decode_requests``
    Requests scheduled for exactly one position after having produced output.
``decode_context_tokens``
    Sum over those decode requests of their context length (positions attended to).

Absolute simulated latencies are not predictions of real hardware; every policy arm of a
replay uses the same model, so relative comparisons are the deliverable.

Preset ``llama-3.1-8b-h100`` (the default), Llama-3.1-8B-Instruct in BF16/FP16 on one
NVIDIA H100-80GB (SXM, HBM3), vLLM:

* ``a = 6.5 ms``: per-step fixed cost. Measured single-request decode TPOT p50 = 6.48 ms
  for Llama-3.1-8B-Instruct, fp16, vLLM 0.21.0, one H100-80GB-HBM3 (InferenceBench
  "concurrency sweep" recipe, validation run 2026-05-16,
  https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/). A one-request decode
  step is dominated by reading the 16 GB of weights once, which every step pays.
* ``c = 0.28 ms`` per decode request: the same run measured TPOT p50 = 10.94 ms at
  concurrency 16, i.e. (10.94 - 6.48) / 15 = 0.30 ms per extra running request; we keep
  0.28 ms for the per-request part and assign the rest to ``d`` below.
* ``d = 39 ns`` per context token: reading the KV cache. Llama-3.1-8B has 32 layers, 8 KV
  heads of dimension 128, so one token's K and V in 16-bit take 32*8*128*2*2 = 128 KiB;
  at the H100 SXM's 3.35 TB/s datasheet bandwidth that is 39 ns per token.
* ``b = 32.5 us`` per prefill token: 2 * 8.03e9 FLOP per token at 50 % of the H100 SXM's
  989 TFLOP/s dense BF16 datasheet peak. The 50 % utilisation is our assumption, not a
  measurement; it gives about 31k prefill tokens/s, i.e. 0.27 s for an 8,192-token chunk.

Other presets or measured fits go in a JSON or TOML file with the keys ``name``, ``a``,
``b``, ``c``, ``d`` (seconds) and an optional ``source`` string (``--step-model FILE``).
"""

from __future__ import annotations

import json
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bidkv_ext.replay.jsontext import error_location

__all__ = [
    "PRESETS",
    "StepTimeModel",
    "StepTimeModelError",
    "check_step_bound",
    "load_step_model",
]


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Linear step-time model; all coefficients in seconds (per unit)."""

    name: str
    a: float
    b: float
    c: float
    d: float
    source: str = ""

    def step_seconds(self, prefill_tokens: int, decode_requests: int, decode_context: int) -> float:
        return self.a + self.b * prefill_tokens + self.c * decode_requests + self.d * decode_context

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "a": self.a, "b": self.b, "c": self.c, "d": self.d,
                "source": self.source}


PRESETS: dict[str, StepTimeModel] = {
    "llama-3.1-8b-h100": StepTimeModel(
        name="llama-3.1-8b-h100",
        a=6.5e-3,
        b=32.5e-6,
        c=0.28e-3,
        d=39e-9,
        source=(
            "a,c: InferenceBench concurrency sweep, Llama-3.1-8B-Instruct fp16, vLLM 0.21.0, "
            "1x H100-80GB-HBM3 (TPOT p50 6.48 ms @1, 10.94 ms @16); d: 128 KiB KV/token at "
            "3.35 TB/s; b: 16.06 GFLOP/token at 50% of 989 TFLOP/s (assumed MFU)"
        ),
    ),
}


MIN_STEP_SECONDS = 1e-6
"""The least fixed cost of a step a model file may set: far below any real engine's
(milliseconds), yet it keeps every rate finite (with ``a`` at 1e-320 s tokens per second
overflowed to infinity, which the report cannot hold, after every arm had run)."""


class StepTimeModelError(ValueError):
    """A step-time model file that cannot be used."""


class _ModelFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Finite: an infinite coefficient makes every step last forever (the report's JSON
    # cannot even hold it), and json.loads accepts Infinity and NaN. The fixed cost of a
    # step is at least MIN_STEP_SECONDS: with it 0, a step could take no time, and a run no
    # time at all (throughput and goodput would divide by a zero makespan); with it tiny,
    # they overflow.
    name: str = Field(min_length=1)
    a: float = Field(ge=MIN_STEP_SECONDS, allow_inf_nan=False)
    b: float = Field(ge=0, allow_inf_nan=False)
    c: float = Field(ge=0, allow_inf_nan=False)
    d: float = Field(ge=0, allow_inf_nan=False)
    source: str = ""


def load_step_model(spec: str) -> StepTimeModel:
    """A preset name, or a path to a ``.json``/``.toml`` file with name, a, b, c, d."""
    preset = PRESETS.get(spec)
    if preset is not None:
        return preset
    path = Path(spec)
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            # A pipe with no writer would block the run here for good.
            raise StepTimeModelError(
                f"step model {spec!r}: expected a preset ({', '.join(sorted(PRESETS))}) or a "
                "regular file, got a pipe, device or directory")
        raw = path.read_bytes()
    except OSError as exc:
        names = ", ".join(sorted(PRESETS))
        raise StepTimeModelError(
            f"step model {spec!r}: not a preset ({names}) and not a readable file "
            f"({exc.strerror or exc})"
        ) from None
    try:
        data = tomllib.loads(raw.decode()) if path.suffix.lower() == ".toml" else json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StepTimeModelError(f"{path}: not valid JSON/TOML ({exc})") from None
    except RecursionError:
        raise StepTimeModelError(f"{path}: JSON/TOML nested too deeply") from None
    try:
        # Strict: JSON and TOML carry types, so true or "0.5" is a mistake, not a number
        # (as in a capacity schedule); an integer still reads as a float.
        parsed = _ModelFile.model_validate(data, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = error_location(first["loc"], "<root>")
        raise StepTimeModelError(
            f"{path}: {where}: {first['msg']} (expected keys name, a, b, c, d: finite numbers, "
            f"a >= {MIN_STEP_SECONDS:g} and the others >= 0, source)"
        ) from None
    return StepTimeModel(parsed.name, parsed.a, parsed.b, parsed.c, parsed.d, parsed.source)


def check_step_bound(
    model: StepTimeModel,
    spec: str,
    limit: float,
    *,
    prefill_tokens: int,
    decode_requests: int,
    decode_context: int,
) -> None:
    """Refuse a model whose longest possible step (every count at its scheduler limit)
    exceeds ``limit`` seconds or is not finite: finite coefficients such as 1e307 still
    overflow to inf once multiplied, and an infinite clock ends in a report JSON cannot
    hold, after every arm has run. ``spec`` is the preset name or file the user gave."""
    worst = model.step_seconds(prefill_tokens, decode_requests, decode_context)
    if not worst <= limit:  # not "worst > limit": that is False for NaN
        raise StepTimeModelError(
            f"step model {spec}: the longest step ({prefill_tokens} prefill tokens, "
            f"{decode_requests} decode requests, {decode_context} context tokens: the limits "
            "--max-num-batched-tokens, --max-num-seqs and --max-num-seqs x --max-model-len) "
            f"takes {worst:g} s; expected coefficients and limits that keep a step below "
            f"{limit:g} s")
