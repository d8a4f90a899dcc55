"""The ``vllm-hust-ext`` console entry: the CLI, even when importing it fails.

Importing the CLI builds pydantic models, and pydantic reads every installed
distribution's entry points while it does; a damaged one elsewhere on the path would
otherwise end every command, ``--version`` included, in a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from hust_ext_manager.cli import main as cli_main
    except (TypeError, ValueError) as error:
        from hust_ext_manager.metadata_scan import unreadable_entry_points

        reason = unreadable_entry_points() or f"{type(error).__name__}: {error}"
        print(f"vllm-hust-ext: error: cannot start: {' '.join(reason.splitlines())}",
              file=sys.stderr)
        return 2
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
