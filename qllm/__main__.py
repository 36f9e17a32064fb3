"""``python -m qllm``: the ``qllm`` command."""

import sys

from qllm.cli import main

sys.exit(main())
