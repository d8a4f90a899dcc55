"""``kvcached-provider cleanup`` and a process that still maps an earlier copy of a record.

Guarded: ``/proc/<pid>/maps`` shows such a mapping as ``<path> (deleted)``; the process
still uses the instance, so the current record is kept and the process named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_cleanup_keeps_a_record_whose_earlier_file_a_process_still_maps(
    tmp_path: Path,
) -> None:
    """A process that mapped an instance's record (fd closed) keeps mapping it after the
    file was removed and recreated; /proc/<pid>/maps then shows ``<path> (deleted)``. That
    process still uses the instance, so cleanup must keep the current record, naming it."""
    from kvcached_provider.segments import cleanup

    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    record = shm / "inst-map"
    record.write_bytes(b"\1" + b"\0" * 23)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import mmap, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDWR)\n"
         "m = mmap.mmap(fd, 24)\n"
         "for n in os.listdir('/proc/self/fd'):  # mmap keeps a dup: close it too\n"
         "    try:\n"
         "        if os.readlink(f'/proc/self/fd/{n}') == sys.argv[1]: os.close(int(n))\n"
         "    except OSError: pass\n"
         "print(flush=True)\n"
         "time.sleep(60)\n", str(record)],
        env={k: v for k, v in os.environ.items() if k != "KVCACHED_IPC_NAME"},
        stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline()  # mapped, fd closed
        record.unlink()
        record.write_bytes(b"\1" + b"\0" * 23)  # the instance's record, recreated
        report = cleanup("inst-map", shm=shm, tmp=tmp)
        assert report.removed == ()
        assert report.kept == ((str(record), f"in use by pid {holder.pid}"),)
    finally:
        holder.kill()
        holder.wait()
    assert record.exists()
