"""``python -m kvcached_provider`` runs the ``kvcached-provider`` command."""

from __future__ import annotations

from kvcached_provider.cli import main

raise SystemExit(main())
