"""A missing source: a name a brace range or pattern produced that does not exist, or a data
file a saved dataset lists that is gone. It is one `manifest.missing_shard` error row (404),
reported by the one task whose range holds its place, and the run goes on."""

from __future__ import annotations

from typing import Any, Iterator

from ..config import ManifestConfig
from ..errors import ManifestError, MMError
from .lines import Raw
from .registry import WHOLE, Format, Part, Record, Source, register


class Missing(Format):
    """The pseudo-format of a source that is not there: its records are its one error row."""

    name, slicing = "missing", WHOLE

    def records(self, src: Source, cfg: ManifestConfig, part: Part) -> Iterator[Record]:
        """The source's one error row."""
        yield self.missing(src)

    def missing(self, src: Source) -> Raw:
        """The error row of the missing source, saying who named it."""
        return None, 0, None, MMError(self.message(src), stage="read", reason="manifest.missing_shard")

    def message(self, src: Source) -> str:
        """What the error row says: the file that lists it, or the pattern."""
        by = "listed in " + src.meta if src.meta else "named by a brace range or pattern"
        return f"{src.path} does not exist ({by})"

    def record(self, path: str, offset: int, limit: int,
               key: str | None) -> tuple[dict[str, Any] | None, MMError | None]:
        """Nothing to reread: the source is gone."""
        raise ManifestError(f"manifest not found: {path}")


MISSING = register(Missing())
