"""On/off switches read from the environment (``QLLM_PDL``, ``QLLM_PARALLEL_AUTOTUNE``): ``0``
off, ``1`` on, unset or empty the default; any other value is refused, so a typo such as
``false`` cannot leave a switch silently in its default."""

from __future__ import annotations

import os


def env_switch(name: str, default: bool = True) -> bool:
    """The switch in environment variable ``name``: ``0`` off, ``1`` on, unset or empty
    ``default``; raises ``ValueError`` naming the variable for any other value."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r}: 1 (on) or 0 (off)")
    return default if value == "" else value == "1"
