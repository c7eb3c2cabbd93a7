"""The timestamps mmenc writes, each format in one place: error rows, task metadata, locks and
sbatch scripts say when (`timestamp`); a generated file's name sorts by it (`file_stamp`).

Local time with its UTC offset (`2024-05-01T14:03:07+0200`): a person reads it where the run ran,
and a script can still order and convert it. `status` shows its month to second as sliced text.
"""

from __future__ import annotations

import time

#: ISO 8601 to the second, with the UTC offset
FORMAT = "%Y-%m-%dT%H:%M:%S%z"


def timestamp(when: float | None = None) -> str:
    """`when` (seconds since the epoch; now when None) as local time in `FORMAT`."""
    return time.strftime(FORMAT, time.localtime(when))


def file_stamp(when: float | None = None) -> str:
    """`when` (now when None) as local time for a file name: `YYYYmmdd-HHMMSS`, no colons, sorting
    in time order."""
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
