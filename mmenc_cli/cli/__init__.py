"""The `mmenc` command line: parse options, build a config, call the core, render, exit.

The core never imports this package; this package is the only place that formats for people
(`render.py`) and maps exceptions to exit codes (`exits.py`).
"""

from .app import app, main

__all__ = ["app", "main"]
