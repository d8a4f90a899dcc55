"""``python -m hust_ext_manager`` runs the CLI."""

import sys

from hust_ext_manager.console import main

sys.exit(main())
