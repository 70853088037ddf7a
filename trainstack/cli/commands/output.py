"""The rich console for the commands whose panels and tables must fit 120 columns (status, show, diff):
at most 120 wide in a terminal, and exactly 120 when piped (rich would assume 80)."""

from __future__ import annotations

import os
import sys
from typing import Any

WIDTH = 120


def console() -> Any:
    from rich.console import Console

    if "COLUMNS" in os.environ or sys.stdout.isatty():
        return Console(width=min(Console().width, WIDTH))
    return Console(width=WIDTH)
