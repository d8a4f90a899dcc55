"""Behaviours a mutation audit of the replay loop (engine.py), the elastic capacity pool
(capacity.py) and the kvcached name claim (claim.py) found unguarded by any other test.

- Replay loop (real vLLM 0.33.0 scheduler; a unit step model, 1 s per step, keeps the times
  exact): each request reaches the scheduler with its trace arrival time, which priority
  scheduling orders waiting requests by; after the clock jumps, a scheduler still stuck is
  again asked twice before the next jump.
- Elastic pool: a growth to exactly the reserve the shrink already holds releases nothing
  (the prefix cache of the blocks freed meanwhile survives); a summary taken before
  ``finish()`` reports no released reserve; while a shrink is pending the pool's published
  current capacity is its effective limit, above the target.
- Name claim: holding twice keeps one descriptor; the claim file and its directory are the
  user's only; an engine's claim waits out a launch check's instant exclusive lock instead
  of failing; holders are found through a symlinked state directory; a process whose
  descriptors cannot be read is not named; a launcher claiming twice still holds the name,
  and holds it shared, so its own engine can join.

The claim tests need no vLLM; the others skip without it.
"""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvcached_provider import claim
from tests.conftest import HAVE_VLLM

needs_vllm = pytest.mark.skipif(not HAVE_VLLM,
                                reason="vLLM is not installed (real-scheduler tier)")

NAME = "llama-8000"


def _unit_model() -> Any:
    from bidkv_ext.replay.steptime import StepTimeModel

    return StepTimeModel("unit", a=1.0, b=0.0, c=0.0, d=0.0)


def _capacity(points: list[dict[str, float]], usable: int) -> Any:
    from bidkv_ext.replay.capacity import parse_capacity_schedule

    return parse_capacity_schedule(points, "schedule", usable)


# -- replay loop (engine.py) ---------------------------------------------------------------


@needs_vllm
def test_priority_scheduling_orders_waiting_requests_by_their_trace_arrival() -> None:
    """Mutant: every request added with arrival time 0. vLLM's priority scheduling orders
    waiting requests by (priority, arrival time, request id). One sequence at a time:
    request 0 (t=0) decodes until 6 while requests 2 (t=1) and 10 (t=2) wait; request 2
    runs first (7), then 10 (8). With equal arrival times the ids decide, and "10" sorts
    before "2"."""
    from bidkv_ext.replay.arms import named_arm
    from bidkv_ext.replay.engine import ReplaySettings, run_arm
    from bidkv_ext.replay.trace import TraceRequest

    requests = (TraceRequest(0, 0.0, 4, 6), TraceRequest(2, 1.0, 4, 1),
                TraceRequest(10, 2.0, 4, 1))
    settings = ReplaySettings(num_gpu_blocks=16, max_num_seqs=1, scheduling_policy="priority",
                              enable_prefix_caching=False)
    run = run_arm(requests, named_arm("builtin", 0), settings, _unit_model())
    assert [(o.request_id, o.first_token, o.finish) for o in run.outcomes] == [
        ("0", 1.0, 6.0), ("2", 7.0, 7.0), ("10", 8.0, 8.0)]


@needs_vllm
def test_after_a_jump_a_still_stuck_scheduler_is_asked_twice_again() -> None:
    """Mutant: the idle-step count kept after the clock jumps. Request 0 needs 3 blocks;
    capacity is 1 block until t=105, 2 until t=110, then 3. Two idle steps at t=100, jump
    to the growth at 105 (still too few blocks), two idle steps again, jump to 110, prefill
    110-111 and decode 111-112; request 1 after the gap: 7 steps. Keeping the count made
    the second jump after one idle step (6 steps)."""
    from bidkv_ext.replay.arms import named_arm
    from bidkv_ext.replay.engine import ReplaySettings, run_arm
    from bidkv_ext.replay.trace import TraceRequest

    requests = (TraceRequest(0, 100.0, 40, 2), TraceRequest(1, 120.0, 4, 1))
    settings = ReplaySettings(
        num_gpu_blocks=4, enable_prefix_caching=False, blocks_per_page=1,
        capacity_schedule=_capacity(
            [{"t": 0, "blocks": 1}, {"t": 5, "blocks": 2}, {"t": 10, "blocks": 3}], 3))
    run = run_arm(requests, named_arm("builtin", 0), settings, _unit_model())
    assert [(o.first_token, o.finish) for o in run.outcomes] == [(111.0, 112.0),
                                                                 (121.0, 121.0)]
    assert run.steps == 7


# -- elastic pool (capacity.py) ------------------------------------------------------------


@needs_vllm
def test_a_growth_to_the_reserve_already_held_keeps_the_prefix_cache() -> None:
    """Mutant: a growth releasing the whole reserve when it exactly fits the new target
    (``excess >= 0``), then taking as many free blocks back. 6 usable blocks, one-block
    pages, prefix caching on. At t=0 request 0 (20 prompt tokens of Mooncake hash block 0)
    takes 2 blocks, requests 1 and 2 one each; at t=1 capacity shrinks to 1 and the
    reserve takes the 2 free blocks. At t=3 request 0 finishes, leaving its full first
    block cached and free, and capacity grows to 4: the reserve of 2 is what the new target
    needs, so nothing moves. Request 3 (t=20, the same prompt) hits the cached block: 52
    positions computed (22 + 13 + 13 + 4). Re-taking evicted it (68)."""
    from bidkv_ext.replay.arms import named_arm
    from bidkv_ext.replay.engine import ReplaySettings, run_arm
    from bidkv_ext.replay.trace import TraceRequest

    requests = (TraceRequest(0, 0.0, 20, 3, (0,)), TraceRequest(1, 0.0, 4, 10),
                TraceRequest(2, 0.0, 4, 10), TraceRequest(3, 20.0, 20, 1, (0,)))
    settings = ReplaySettings(
        num_gpu_blocks=7, blocks_per_page=1,
        capacity_schedule=_capacity([{"t": 1, "blocks": 1}, {"t": 3, "blocks": 4}], 6))
    run = run_arm(requests, named_arm("builtin", 0), settings, _unit_model())
    assert [(o.first_token, o.finish) for o in run.outcomes] == [
        (1.0, 3.0), (1.0, 10.0), (1.0, 10.0), (21.0, 21.0)]
    assert run.computed_tokens == 52
    cap = run.capacity
    assert cap is not None
    assert (cap["shrinks"], cap["grows"], cap["shrinks_completed"]) == (1, 1, 1)
    assert cap["reserved_blocks_end"] == 2 and cap["free_blocks_end"] == 4


def _block_pool(num_blocks: int) -> Any:
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_blocks, enable_caching=True, hash_block_size=16)


@needs_vllm
def test_a_summary_before_finish_reports_no_released_reserve() -> None:
    """Mutant: ``reserve_released`` read only the reserve's emptiness. Before ``finish()``
    nothing was released, even with an empty reserve (no shrink yet): the summary says
    so; ``finish()`` then reports the release."""
    from bidkv_ext.replay.capacity import ElasticPool

    elastic = ElasticPool(_block_pool(17), _capacity([{"t": 5, "blocks": 8}], 16),
                          blocks_per_page=4)
    elastic.before_step(0.0)
    assert elastic.summary()["reserve_released"] is False
    assert elastic.finish()["reserve_released"] is True


@needs_vllm
def test_a_pending_shrink_publishes_the_pool_s_current_capacity_above_its_limit() -> None:
    """Mutant: the pool's ``current_capacity_bytes`` published as the limit. 32 usable
    blocks in pages of 8, requests hold 31; a shrink to 28 reserves the one free block and
    waits: the limit is the target (28 blocks), the pool's current capacity and effective
    limit are 31 blocks (usable minus the reserve), until the requests free blocks."""
    from bidkv_ext.replay.capacity import PAGE_BYTES, ElasticPool

    pool = _block_pool(33)
    held = pool.get_new_blocks(31)
    elastic = ElasticPool(pool, _capacity([{"t": 0, "blocks": 28}], 32), blocks_per_page=8)
    elastic.before_step(0.0)
    block = PAGE_BYTES // 8
    (got,) = elastic.capacity_signals().pools
    assert got.in_shrink and got.target_num_blocks == 28 and got.available_blocks == 0
    assert (got.limit_bytes, got.effective_limit_bytes, got.current_capacity_bytes) == (
        28 * block, 31 * block, 31 * block)
    assert got.mapped_bytes == 4 * PAGE_BYTES and got.physical_free_pages == 1
    pool.free_blocks(held)
    elastic.finish()


# -- kvcached name claim (claim.py) --------------------------------------------------------


def _python(code: str, state: Path) -> subprocess.Popen[str]:
    """A process running ``code`` with ``state`` as its provider state directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env["KVCACHED_PROVIDER_STATE_DIR"] = str(state)
    return subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


_HOLDER = (
    "import sys\n"
    "from kvcached_provider import claim\n"
    f"claim.hold({NAME!r})\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
)


def test_holding_a_claim_twice_keeps_one_descriptor(tmp_path: Path) -> None:
    """Mutants: ``hold`` without its idempotency check, or without recording the claim.
    A second ``hold`` in the same process returns the same file and opens nothing more:
    one descriptor on the claim."""
    code = (
        "import os\n"
        "from kvcached_provider import claim\n"
        f"first = claim.hold({NAME!r})\n"
        f"second = claim.hold({NAME!r})\n"
        "target = os.path.realpath(first)\n"
        "fds = [f for f in os.listdir('/proc/self/fd')\n"
        "       if os.path.realpath('/proc/self/fd/' + f) == target]\n"
        "print(first == second, len(fds))\n"
    )
    proc = _python(code, tmp_path)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.split() == ["True", "1"]


def test_the_claim_file_and_its_directory_are_the_user_s_only(tmp_path: Path) -> None:
    """Mutant: the claim file created 0o644. The claim file is created 0o600 in a 0o700
    directory."""
    proc = _python(_HOLDER, tmp_path)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        path = claim.claim_path(NAME, tmp_path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    finally:
        proc.kill()
        proc.communicate()


def test_an_engine_s_claim_waits_out_a_launch_check_s_exclusive_lock(tmp_path: Path) -> None:
    """Mutant: ``hold`` asking for its shared lock without waiting. A launch check holds
    the claim exclusively for an instant; an engine's plugin taking its claim then waits
    for it (seen in /proc/locks as a blocked request, "->") and gets the claim once the
    check lets go, instead of failing."""
    path = claim.claim_path(NAME, tmp_path)
    path.parent.mkdir(parents=True)
    path.touch()
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    proc = _python(f"from kvcached_provider import claim\nprint(claim.hold({NAME!r}))\n",
                   tmp_path)
    try:
        inode = f":{os.stat(path).st_ino} "
        while proc.poll() is None:
            locks = Path("/proc/locks").read_text().splitlines()
            if any("->" in line and f" {proc.pid} " in line and inode in line
                   for line in locks):
                break
            time.sleep(0.01)
    finally:
        os.close(fd)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == str(path)


def test_holders_are_named_through_a_symlinked_state_directory(tmp_path: Path) -> None:
    """Mutant: the claim's path compared unresolved with the processes' descriptors, which
    link to the real path. With the state directory a symlink, the engine holding the
    claim is still named."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    proc = _python(_HOLDER, link)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        assert claim.holders(NAME, link) == [proc.pid]
    finally:
        proc.kill()
        proc.communicate()


def test_a_process_whose_descriptors_cannot_be_read_is_not_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant: a process whose descriptors cannot be listed counted as a holder. Another
    user's process (its /proc/<pid>/fd unreadable) is not named: the pids only name the
    holders that can be seen. Root reads every /proc entry, so a directory stands in for
    /proc here, with a process entry that has no fd directory; the lock is a real one."""
    proc = _python(_HOLDER, tmp_path / "state")
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        fake = tmp_path / "proc"
        (fake / "4242").mkdir(parents=True)
        monkeypatch.setattr(claim, "_PROC", fake)
        assert claim.holders(NAME, tmp_path / "state") == []
    finally:
        proc.kill()
        proc.communicate()


def test_a_launcher_claiming_twice_holds_the_name_shared(tmp_path: Path) -> None:
    """Mutants: ``claim_for_launch`` without its idempotency check, without recording the
    claim, or keeping the exclusive lock of its test. A launcher that checks twice holds
    the name both times (``None``, not a list of other holders), and holds it shared: its
    own engine's plugin can take the shared lock at once, and the launcher is the one
    holder named."""
    proc = _python(
        "import sys\nfrom kvcached_provider import claim\n"
        f"print(claim.claim_for_launch({NAME!r}), claim.claim_for_launch({NAME!r}),"
        " flush=True)\nsys.stdin.readline()\n", tmp_path)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["None", "None"]
        fd = os.open(claim.claim_path(NAME, tmp_path), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # raises if held exclusively
        finally:
            os.close(fd)
        assert claim.holders(NAME, tmp_path) == [proc.pid]
    finally:
        proc.kill()
        proc.communicate()
