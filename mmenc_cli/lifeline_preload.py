"""Preloaded by the decode workers' forkserver as it starts (`run/decode_pool.start_forkserver`):
the forkserver dies with the encode process that started it when that process asked for it
(`lifeline.require`, under an engine such as Ray). Nothing else imports this module."""

from __future__ import annotations

from .lifeline import inherit

inherit()
