"""The kvcached provider against a real kvcached on a real GPU (skipped elsewhere).

Every other kvcached test fakes kvcached at the module boundary, because kvcached needs a
CUDA build of torch and its compiled extension. This module runs where both exist
(``scripts/kvcached-gpu-check.sh`` builds kvcached 0.1.6 from its sdist and runs it) and
guards what the fakes can only assume:

- the pool's control record is the 24-byte ``/dev/shm/<KVCACHED_IPC_NAME>`` whose
  ``total_size`` at start-up is the pool's virtual capacity (what ``limit``'s first-use
  ``kvctl`` check compares against) and is the segment ``_segment_of`` names;
- a revisioned limit applied in the process holding the pool reaches kvcached's pool, and
  the capacity signals the policy reads follow it, through a deferred shrink to its end;
- ``pages_released`` predicts exactly how many pages kvcached takes out of use when the
  blocks go (an emptied page joins kvcached's reserve of mapped pages until the shrink ends);
- the vLLM plugin's responder answers ``kvcached-provider limit`` run in another process,
  and gives the pool a real lock first;
- a limit written by kvcached's own ``kvctl`` is detected and refused;
- ``kvcached-provider cleanup`` keeps the record and the worker socket directory of a live
  engine and removes both once the engine was killed, and a launch under a live engine's
  name is refused because the engine uses the record;
- the pre-launch checks read kvcached's and torch's real metadata: version, compiled
  module, CUDA build and torch floor all pass on a real build;
- the fake pool every CI test uses (tests/fake_kvcached.py) follows a real pool of the
  same geometry through one scripted life: allocations, a deferred shrink and its end,
  and the revision rules, compared on everything the provider reads, with kvcached's
  prealloc thread off and on.

The tests share one pool and run in file order: each builds on the limit the previous one
left (revisions only grow). The shared pool runs with kvcached's prealloc thread off unless
``BIDKV_REAL_KVCACHED_PREALLOC=true`` (scripts/kvcached-gpu-check.sh runs the module both
ways).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("kvcached") is None:
    pytest.skip("needs a real kvcached build (scripts/kvcached-gpu-check.sh)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
IPC = f"bidkv_real_{os.getpid()}"
NUM_LAYERS = 4
BLOCK = 16
HEADS, HEAD_DIM = 8, 64
CELL = HEADS * HEAD_DIM * 2  # bytes per token per layer for K (or V), float16
NUM_BLOCKS = 8192
MIB = 1 << 20
# kvcached maps spare pages ahead from a background thread unless told not to (its default is
# on). The shared pool runs with it off, so that page counts are exact; set
# BIDKV_REAL_KVCACHED_PREALLOC=true to run the module's tests under kvcached's default.
PREALLOC = os.environ.get("BIDKV_REAL_KVCACHED_PREALLOC", "false")


def open_pool(ipc: str, *, async_sched: bool = False) -> Any:
    """Create and register one vLLM-style kvcached pool, as kvcached's vLLM integration does
    (``async_sched``: as under vLLM's async scheduling, where emptied pages are retired until
    the engine releases them).

    ``KVCACHED_IPC_NAME`` must be set before kvcached is first imported (it names the
    segment at import time).
    """
    assert os.environ.get("KVCACHED_IPC_NAME") == ipc
    import torch
    from kvcached.integration.vllm import interfaces

    interfaces.init_kvcached(tp_rank=0, world_size=1, is_worker=True, async_sched=async_sched)
    interfaces.alloc_kv_cache(kvcache_shape=(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM),
                              block_size=BLOCK, dtype=torch.float16, device="cuda:0",
                              num_layers=NUM_LAYERS)
    manager = interfaces.get_kv_cache_manager(NUM_BLOCKS, BLOCK, CELL, NUM_LAYERS)
    manager._wait_post_init()
    return manager


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvcached-provider-state")


@pytest.fixture(scope="module")
def pool(state: Path) -> Iterator[Any]:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    saved = {k: os.environ.get(k) for k in ("KVCACHED_IPC_NAME", "KVCACHED_PAGE_PREALLOC_ENABLED",
                                            "KVCACHED_PROVIDER_STATE_DIR")}
    os.environ["KVCACHED_IPC_NAME"] = IPC
    os.environ["KVCACHED_PAGE_PREALLOC_ENABLED"] = PREALLOC
    os.environ["KVCACHED_PROVIDER_STATE_DIR"] = str(state)
    manager = open_pool(IPC)
    try:
        yield manager
    finally:
        from kvcached.integration.vllm import interfaces

        interfaces.shutdown_kvcached()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def capacity(manager: Any) -> int:
    return int(manager.mem_size) * int(manager.num_layers) * int(manager.num_kv_buffers)


def bundle(manager: Any) -> int:
    """Bytes one page costs across every layer and buffer: kvcached's limit granularity."""
    return int(manager.page_size) * int(manager.num_layers) * int(manager.num_kv_buffers)


def provider(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("KVCACHED_IPC_NAME", None)  # the command runs outside the engine
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "kvcached_provider", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_control_record_is_the_one_the_provider_reads(pool: Any) -> None:
    """The segment is /dev/shm/<ipc>, 24 bytes, total_size = the pool's virtual capacity."""
    from kvcached_provider.checks import shm_dir
    from kvcached_provider.limit import _segment_of, _startup_violation, read_control_record

    assert pool.ipc_name == IPC
    assert _segment_of(pool, IPC) == IPC
    path = shm_dir() / IPC
    assert path.stat().st_size == 24
    record = read_control_record(IPC)
    assert record is not None
    assert record.total_size == capacity(pool) == NUM_BLOCKS * BLOCK * CELL * NUM_LAYERS * 2
    assert _startup_violation(IPC, shm_dir()) is None


def test_in_process_limit_reaches_the_pool_and_the_signals(pool: Any, state: Path) -> None:
    """A limit applied where the pool lives caps kvcached's pool; the signals report it."""
    from kvcached_provider.limit import set_limit
    from kvcached_provider.signals import current_signals

    limit = capacity(pool) // 2
    result = set_limit(IPC, limit, directory=state)
    assert (result.status, result.via, result.revision) == ("applied", "in-process", 1)
    assert result.effective_limit_bytes == limit // bundle(pool) * bundle(pool)
    kv_state = pool.memory_limit_state()
    assert (kv_state["limit_bytes"], kv_state["revision"]) == (limit, 1)
    pages = limit // bundle(pool)
    blocks_per_page = pool.page_size // pool.block_mem_size
    assert pool.available_size() <= pages * blocks_per_page
    assert pool.alloc(pages * blocks_per_page + 1) is None
    signals = current_signals()
    assert signals is not None
    assert signals.memory_limit_bytes == limit
    assert signals.effective_limit_bytes == result.effective_limit_bytes
    assert not signals.in_shrink
    assert signals.available_blocks == pool.available_size()
    assert signals.physical_free_pages is not None and signals.physical_free_pages > 0


def test_deferred_shrink_is_signalled_and_pages_released_is_exact(pool: Any,
                                                                  state: Path) -> None:
    """Below the in-use pages a limit is deferred; pages_released predicts the pages kvcached
    takes out of use."""
    from kvcached_provider.limit import set_limit
    from kvcached_provider.signals import current_signals, pages_released

    blocks_per_page = pool.page_size // pool.block_mem_size
    ids = pool.alloc(20 * blocks_per_page)
    assert ids is not None
    result = set_limit(IPC, 10 * bundle(pool), directory=state)
    assert (result.status, result.reason) == ("deferred", "inuse_capacity_above_limit")
    signals = current_signals()
    assert signals is not None and signals.in_shrink
    assert pool.in_shrink

    # Freeing one block of a page other blocks still hold empties no page.
    assert pages_released(ids[:1]) == 0
    # Free a third of the blocks, then the rest: each time the pages kvcached takes out of
    # use are exactly those predicted.
    for part in (ids[: len(ids) // 3], ids[len(ids) // 3 :]):
        predicted = pages_released(part)
        before = pool.page_allocator.get_num_inuse_pages()
        pool.free(part)
        assert before - pool.page_allocator.get_num_inuse_pages() == predicted
    assert predicted is not None and predicted > 0
    signals = current_signals()
    assert signals is not None and not signals.in_shrink
    assert pool.memory_limit_state()["status"] == "applied"


def test_responder_serves_a_command_run_in_another_process(
        pool: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vLLM plugin's responder locks the pool and applies a limit sent from outside."""
    from kvcached_provider import activation

    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    # Set before register(), so that teardown puts back "none started", not the stopped one.
    monkeypatch.setattr(activation, "_responder", None)
    responder = activation.register()
    assert responder is not None
    try:
        limit = 768 * MIB
        done = provider("limit", "--ipc", IPC, "768M", "--json", "--timeout", "60")
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert (answer["status"], answer["via"], answer["revision"]) == ("applied", "engine", 3)
        assert pool.memory_limit_state()["limit_bytes"] == limit
        assert isinstance(pool._lock, type(threading.RLock()))
    finally:
        responder.stop()


def test_a_kvctl_limit_is_detected_and_refused(pool: Any, state: Path) -> None:
    """After kvcached's own `kvctl limit`, a revisioned limit is refused; the pool keeps its
    own, and a first-use check on this record would refuse too."""
    from kvcached_provider.checks import shm_dir
    from kvcached_provider.limit import _startup_violation, read_control_record, set_limit

    before = pool.memory_limit_state()["limit_bytes"]
    env = dict(os.environ)
    kvctl = subprocess.run([sys.executable, "-m", "kvcached.cli.kvctl", "limit", IPC, "256M"],
                           env=env, capture_output=True, text=True, timeout=120, check=False)
    assert kvctl.returncode == 0, kvctl.stderr
    record = read_control_record(IPC)
    assert record is not None and record.total_size == 256 * MIB
    # An engine's first revisioned limit would see the kvctl total too (no marker needed).
    assert _startup_violation(IPC, shm_dir()) is not None
    result = set_limit(IPC, 512 * MIB, directory=state)
    assert (result.status, result.reason, result.via) == ("rejected", "kvctl_limit_detected",
                                                          "none")
    assert pool.memory_limit_state()["limit_bytes"] == before


_ENGINE = """
import os, sys, time
sys.path[:0] = [{root!r}, {src!r}]
from tests.test_kvcached_real import open_pool
pool = open_pool(os.environ["KVCACHED_IPC_NAME"])
print("ready", flush=True)
time.sleep(600)
"""


_LAUNCH_CHECK = """
import json, sys
sys.path[:0] = [{src!r}]
from kvcached_provider.checks import check_ipc_name
print(json.dumps(check_ipc_name({ipc!r}, launching=True)))
"""


def test_cleanup_keeps_a_live_engines_record_and_removes_a_killed_ones(pool: Any) -> None:
    """A SIGKILLed engine leaks its record and socket directory; cleanup removes them then,
    and never while the engine lives."""
    from kvcached_provider.checks import shm_dir
    from kvcached_provider.segments import tp_socket_dir

    ipc = f"{IPC}_leak"
    env = dict(os.environ, KVCACHED_IPC_NAME=ipc)
    engine = subprocess.Popen(
        [sys.executable, "-c", _ENGINE.format(root=str(ROOT), src=str(ROOT / "src"))],
        env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    record = shm_dir() / ipc
    sockets = tp_socket_dir(ipc)  # the worker listener's directory, named as kvcached does
    try:
        assert engine.stdout is not None
        deadline = time.monotonic() + 180
        line = ""
        while time.monotonic() < deadline and line != "ready\n":
            line = engine.stdout.readline()
            if not line:
                break
        assert line == "ready\n", "the engine process did not come up"
        assert record.is_file()
        assert sockets.is_dir() and any(p.is_socket() for p in sockets.iterdir())

        live = provider("cleanup", "--ipc", ipc)
        assert live.returncode == 1, live.stdout + live.stderr
        assert str(engine.pid) in live.stdout + live.stderr
        assert record.is_file()
        # In a child: a launch check claims the name for its process until that exits.
        check = subprocess.run(
            [sys.executable, "-c", _LAUNCH_CHECK.format(src=str(ROOT / "src"), ipc=ipc)],
            env=env, capture_output=True, text=True, timeout=120, check=False)
        assert check.returncode == 0, check.stderr
        refused = [text for ok, text in json.loads(check.stdout) if not ok]
        assert len(refused) == 1 and "in use by pid" in refused[0], check.stdout
        assert str(engine.pid) in refused[0]

        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait(timeout=60)
        assert record.is_file()  # nothing unlinked it: the leak cleanup exists for
        gone = provider("cleanup", "--ipc", ipc)
        assert gone.returncode == 0, gone.stdout + gone.stderr
        assert not record.exists()
        assert not sockets.exists()
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGKILL)
            engine.wait(timeout=60)
        record.unlink(missing_ok=True)
        shutil.rmtree(sockets, ignore_errors=True)


def test_pre_launch_checks_pass_on_a_real_build() -> None:
    """The checks read a real kvcached build's and a CUDA torch's own metadata: each passes
    and names what is installed (the CI tests only ever see faked distributions)."""
    import importlib.metadata as metadata

    import kvcached
    import kvcached._C as native
    import torch
    from packaging.version import Version

    from kvcached_provider.checks import (
        check_compiled_module,
        check_kvcached_version,
        check_torch_backend,
        check_torch_version,
    )

    ok, line = check_kvcached_version()
    assert ok, line
    assert f"kvcached {Version(kvcached.__version__)} is installed" in line
    ok, line = check_compiled_module()
    assert ok, line
    assert Path(line.rsplit(": ", 1)[1]).resolve() == Path(str(native.__file__)).resolve()
    # The distribution's version can lack the import's local tag (2.11.0 for 2.11.0+cu130);
    # the check then asks torch itself and names its CUDA version.
    torch_dist = metadata.version("torch")
    ok, line = check_torch_backend()
    assert ok, line
    assert line.startswith(f"torch {torch_dist} is a CUDA") and torch.version.cuda
    if "+cu" not in torch_dist:
        assert line.endswith(f"is a CUDA {torch.version.cuda} build"), line
    [(ok, line)] = check_torch_version()
    assert ok and line.startswith(f"torch {torch_dist} is at least"), line


_FIDELITY = """
import json, os, sys, time
sys.path[:0] = [{root!r}, {src!r}]
from tests.kvcached_fidelity import fidelity_steps
from tests.test_kvcached_real import open_pool
ASYNC = os.environ["BIDKV_FIDELITY_ASYNC"] == "true"
pool = open_pool(os.environ["KVCACHED_IPC_NAME"], async_sched=ASYNC)
def settle():
    # With prealloc on, a background thread refills the reserve after an allocation; the
    # reading waits until the reserved count has held still for 0.2 s (5 s at most).
    last, since, deadline = -1, time.monotonic(), time.monotonic() + 5
    while time.monotonic() < deadline:
        now = pool.page_allocator.get_num_reserved_pages()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.2:
            return
        time.sleep(0.01)
geometry = {{k: int(getattr(pool, k)) for k in ("mem_size", "block_mem_size", "page_size",
                                                "num_layers", "num_kv_buffers")}}
seen = fidelity_steps(pool, pool.page_allocator.get_num_inuse_pages, settle, ASYNC)
print(json.dumps({{"geometry": geometry, "seen": seen}}), flush=True)
from kvcached.integration.vllm import interfaces
interfaces.shutdown_kvcached()
"""


@pytest.mark.parametrize(("prealloc", "async_sched"),
                         [("false", "false"), ("true", "false"), ("false", "true")],
                         ids=["prealloc-off", "prealloc-on", "async"])
def test_the_fake_pool_follows_a_real_one(prealloc: str, async_sched: str) -> None:
    """The CI tests' fake pool answers as a real pool of the same geometry does, step by
    step, on everything the provider reads (the fakes otherwise rest on reading
    kvcached's source), with kvcached's prealloc thread off and on (its default, refilling
    a reserve of KVCACHED_MIN_RESERVED_PAGES, 5), and as under vLLM's async scheduling
    (thread off). The line it prints (see it with ``-rA``) holds the real answers;
    tests/kvcached_real_fidelity.json keeps them for CI: refresh its ``seen`` (prealloc
    off), ``seen_prealloc`` (on) and ``seen_async`` from those lines' ``real`` after a
    kvcached upgrade or a change to the script."""
    from kvcached_provider.checks import shm_dir
    from kvcached_provider.segments import tp_socket_dir
    from tests.fake_kvcached import FakeKVCacheManager
    from tests.kvcached_fidelity import assert_same_steps, fidelity_steps

    ipc = f"{IPC}_fid_{prealloc}_{async_sched}"
    env = dict(os.environ, KVCACHED_IPC_NAME=ipc, KVCACHED_PAGE_PREALLOC_ENABLED=prealloc,
               BIDKV_FIDELITY_ASYNC=async_sched)
    env.pop("KVCACHED_MIN_RESERVED_PAGES", None)
    env.pop("KVCACHED_MAX_RESERVED_PAGES", None)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _FIDELITY.format(root=str(ROOT), src=str(ROOT / "src"))],
            env=env, capture_output=True, text=True, timeout=300, check=False)
    finally:
        (shm_dir() / ipc).unlink(missing_ok=True)
        shutil.rmtree(tp_socket_dir(ipc), ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    # kvcached prints to stdout too (its C++ and its shutdown): take the one JSON line.
    [line] = [text for text in done.stdout.splitlines() if text.startswith('{"geometry"')]
    real = json.loads(line)
    g = real["geometry"]
    fake = FakeKVCacheManager(
        num_blocks=g["mem_size"] // g["block_mem_size"], block_mem_size=g["block_mem_size"],
        page_size=g["page_size"], num_layers=g["num_layers"],
        num_kv_buffers=g["num_kv_buffers"], physical_free_pages=1 << 20,
        reserve_null_block=True, min_reserved_pages=5 if prealloc == "true" else 0,
        defer_physical_release=async_sched == "true")
    faked = fidelity_steps(fake, fake.inuse_pages, retiring=async_sched == "true")
    # For -rA / -s, and to refresh the recording.
    print(json.dumps({"prealloc": prealloc, "async": async_sched, "real": real["seen"],
                      "fake": faked}))
    assert_same_steps(faked, real["seen"])
