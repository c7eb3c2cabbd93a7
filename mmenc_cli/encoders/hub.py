"""The Hugging Face hub, looked at once before a hub id is loaded: where it cannot be reached (an
offline GPU node), a model that is not in the local cache is one clear line with what to do, not a
minute of the hub client's retries; a cached one loads from the cache without them."""

from __future__ import annotations

import logging
import os
import socket
from urllib.parse import urlsplit

from ..errors import ModelLoadError

log = logging.getLogger("mmenc")

#: seconds a connection to the hub may take before it counts as unreachable
CONNECT_TIMEOUT = 5.0
_TRUE = {"1", "true", "yes", "on"}


def offline() -> bool:
    """Whether the user asked for the cache only (`HF_HUB_OFFLINE=1`)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def endpoint() -> str:
    """The hub's URL (`HF_ENDPOINT`, a mirror, or huggingface.co)."""
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def reachable(url: str, timeout: float = CONNECT_TIMEOUT) -> bool:
    """Whether a TCP connection to `url`'s host opens within `timeout` (a proxy in the environment
    is taken to reach it: it cannot be judged from here)."""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout):
            return True
    except OSError:  # no DNS, refused, timed out, no route
        return False


def cached(repo: str, revision: str | None) -> bool:
    """Whether the local hub cache holds the model's config (or a sentence-transformers modules.json)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers brings it
        return False
    return any(isinstance(try_to_load_from_cache(repo, name, revision=revision), str)
               for name in ("config.json", "modules.json"))


def _go_offline() -> None:
    """Make the hub client use its cache only, for the rest of this process."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        from huggingface_hub import constants

        constants.HF_HUB_OFFLINE = True
    except (ImportError, AttributeError):  # pragma: no cover
        pass


def check_hub(repo: str, revision: str | None) -> None:
    """Before loading hub id `repo` (see the module docstring): ModelLoadError when the hub cannot be
    reached and the model is not cached; the cache only when it is."""
    if offline() or reachable(endpoint()):
        return
    if cached(repo, revision):
        log.warning("the Hugging Face hub (%s) cannot be reached: loading %s from the local cache", endpoint(), repo)
        _go_offline()
        return
    raise ModelLoadError(
        f"cannot load model {repo!r}: the Hugging Face hub ({endpoint()}) cannot be reached from this machine and "
        f"the model is not in the local cache; download it where there is a network (huggingface-cli download "
        f"{repo} --local-dir DIR, or huggingface_hub.snapshot_download), copy DIR here and pass --model DIR; "
        "or fill the cache and set HF_HUB_OFFLINE=1")
