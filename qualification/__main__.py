"""``python -m qualification``: see :mod:`qualification.cli`."""

from __future__ import annotations

import sys

from qualification.cli import main

sys.exit(main())
