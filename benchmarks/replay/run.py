"""Victim-policy comparison on the three shared traces at three KV budgets each.

Runs ``bidkv-replay`` in-process (vLLM is imported once) for every (trace, budget) cell and
writes the combined table between the markers in ``benchmarks/replay/README.md``.

    .venv/bin/python benchmarks/replay/run.py [--traces DIR] [--out DIR] [--quick]

Slices are fixed (first N requests) so the run fits about 15 minutes on 2 cores; the
KV budgets are chosen per trace for no / moderate / heavy pressure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bidkv_ext.replay.cli import main as replay_main

ROOT = Path(__file__).resolve().parent
POLICIES = "builtin,least-computed-first,largest-first,random,shortest-remaining,bidkv,clairvoyant"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"


@dataclass(frozen=True)
class Cell:
    trace: str
    requests: int
    budgets: tuple[tuple[str, int], ...]
    extra: tuple[str, ...] = ()


CELLS = (
    Cell("azure_llm_2023_conv.csv", 600, (("none", 8192), ("moderate", 1600), ("heavy", 800))),
    Cell("azure_llm_2023_code.csv", 300, (("none", 8192), ("moderate", 1200), ("heavy", 700))),
    Cell("mooncake_fast25_conversation.jsonl", 120,
         (("none", 32768), ("moderate", 6000), ("heavy", 3000)),
         ("--max-model-len", "32768")),
)


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--traces", type=Path, default=Path("/work/shared/traces"))
    scratch = Path(tempfile.gettempdir()) / "bidkv-replay-bench"
    parser.add_argument("--out", type=Path, default=scratch)
    parser.add_argument("--quick", action="store_true", help="a third of each slice")
    args = parser.parse_args()
    rows: list[str] = []
    started = time.perf_counter()
    for cell in CELLS:
        n = max(20, cell.requests // 3) if args.quick else cell.requests
        for pressure, blocks in cell.budgets:
            out = args.out / f"{Path(cell.trace).stem}-{pressure}"
            argv = ["--trace", str(args.traces / cell.trace), "--max-requests", str(n),
                    "--num-gpu-blocks", str(blocks), "--policies", POLICIES, "--no-progress",
                    "--output-dir", str(out), *cell.extra]
            print(f"== {cell.trace} {pressure} ({blocks} blocks, {n} requests)", flush=True)
            if replay_main(argv) != 0:
                return 1
            report = json.loads((out / "report.json").read_text())
            speed = json.loads((out / "timing.json").read_text())
            speeds = speed["simulated_seconds_per_wall_second"]
            trace = report["trace"]
            filtered = trace["filtered_too_long"] + trace["filtered_kv_capacity"]
            for arm in report["arms"]:
                rows.append(
                    f"| {Path(cell.trace).stem} | {pressure} ({blocks}) | "
                    f"{report['trace']['requests']} (-{filtered}) | {arm['label']} | "
                    f"{_pct(arm['recompute_tax'])} | {arm['preemptions_per_1k']:.0f} | "
                    f"{arm['max_preemptions_one_request']} | {_s(arm['ttft_s']['p50'])} | "
                    f"{_s(arm['ttft_s']['p99'])} | {_ms(arm['tpot_s']['p99'])} | "
                    f"{_s(arm['e2e_s']['p99'])} | {arm['throughput_output_tok_s']:.0f} | "
                    f"{arm['goodput_req_s']:.2f} | {speeds[arm['label']]:.1f} |"
                )
    header = (
        "| trace | KV pressure (blocks) | requests (filtered) | policy | recompute tax | "
        "preempt/1k | max preempt | TTFT p50 s | TTFT p99 s | TPOT p99 ms | E2E p99 s | "
        "out tok/s | goodput req/s | sim s / wall s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    total = time.perf_counter() - started
    table = f"{header}\n" + "\n".join(rows) + f"\n\nTotal wall time: {total:.0f} s.\n"
    readme = ROOT / "README.md"
    text = readme.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    readme.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
