"""Models named by a Hub id (`org/name`, `org/name@revision`) wherever a config names a model: before
a stage starts, the id becomes the local snapshot every actor then loads offline, downloaded through
`huggingface_hub` with the user's settings (its cache and HF_HOME, HF_TOKEN, HF_ENDPOINT, and
HF_HUB_OFFLINE as the user set it: rlsys turns the Hub off for the rest of the run), or found in the
cache. `huggingface_hub` locks each file it fetches, so processes on one machine download it once.
A name that is a directory here is a local model, whatever its shape."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time

from rlsys.config.loader import ConfigError, first_line

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
SKIPPED_FILES = ["*.h5", "*.msgpack", "*.ot", "*.onnx", "*.onnx_data", "*.gguf", "*.mlmodel", "original/*", "onnx/*",
                 "coreml/*", "openvino/*"]
"""Formats and copies of the weights that transformers and vLLM do not load here."""
RESOLVED: dict[str, str] = {}
"""Snapshot directory -> the Hub id it was resolved from, in this process (each node fetches its own)."""
_user_offline_setting: bool | None = None
"""HF_HUB_OFFLINE as the user set it, kept by `remember_user_offline` before rlsys turns the Hub off."""


def remember_user_offline() -> None:
    """Keep the user's HF_HUB_OFFLINE (unset: online) before the run sets it for itself."""
    global _user_offline_setting
    if _user_offline_setting is None:
        _user_offline_setting = _is_true(os.environ.get("HF_HUB_OFFLINE", ""))


def is_hub_id(name: str) -> bool:
    return not os.path.isdir(name) and HUB_ID.fullmatch(name) is not None


def resolve(name: str, key: str) -> str:
    """The local directory of `name` (config key `key`): itself unless it is a Hub id, whose snapshot is
    downloaded (or, offline, found in the cache); bad ids end in one ConfigError naming `key`."""
    if not is_hub_id(name):
        return name
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    repo_id, _, revision = name.partition("@")
    offline = _user_offline()
    started = time.perf_counter()
    try:
        with _hub_offline(offline):
            reachable = not offline and _announce(repo_id, revision, name, key)
            path = snapshot_download(repo_id, revision=revision or None, local_files_only=not reachable,
                                     ignore_patterns=SKIPPED_FILES)
    except GatedRepoError:
        raise ConfigError(f"{key}: {name} is gated: accept its terms on the Hub and set HF_TOKEN (or run "
                          f"`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{key}: {name}: no such directory here, nor model at {constants.ENDPOINT} (a private "
                          f"one needs HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{key}: {name}: {repo_id} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else f"{constants.ENDPOINT} cannot be reached"
        raise ConfigError(f"{key}: {name} is not in the Hub cache ({constants.HF_HUB_CACHE}) and {why}") from None
    except (HfHubHTTPError, OSError) as err:
        raise ConfigError(f"{key}: {name}: {first_line(err)}") from None
    log.info("%s: %s is %s (%s, %.1f s)", key, name, path, size_text(weights_bytes(path)),
             time.perf_counter() - started)
    RESOLVED[path] = name
    return path


def weights_bytes(path: str) -> int:
    """The bytes of a model directory's weight files (safetensors, .bin, .pt, .gguf): what loading it reads."""
    if not os.path.isdir(path):
        return 0
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)
               if name.endswith((".safetensors", ".bin", ".pt", ".gguf")))


def size_text(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def fetch_env() -> dict[str, str]:
    """The environment a task on another node fetches a Hub id in: the user's Hub settings, which its
    node's processes do not have."""
    names = ("HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT", "HF_TOKEN", "HF_HUB_DISABLE_PROGRESS_BARS",
             "HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")
    return {"HF_HUB_OFFLINE": "1" if _user_offline() else "0",
            **{name: os.environ[name] for name in names if name in os.environ}}


def _announce(repo_id: str, revision: str, name: str, key: str) -> bool:
    """Ask the Hub for the revision's commit, saying so when it is not in the cache yet: a bad id,
    revision or token fails here, before anything is said. False when the Hub cannot be reached (the
    cache serves, as huggingface_hub itself falls back)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.file_download import repo_folder_name

    try:
        sha = HfApi().repo_info(repo_id, revision=revision or None).sha
    except HfHubHTTPError:
        raise
    except Exception:  # no answer (a refused or timed-out connection)
        return False
    snapshot = os.path.join(constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo_id, repo_type="model"),
                            "snapshots", sha)
    if not os.path.isdir(snapshot):
        log.info("%s: downloading %s from %s", key, name, constants.ENDPOINT)
    return True


def _user_offline() -> bool:
    if _user_offline_setting is not None:
        return _user_offline_setting
    return _is_true(os.environ.get("HF_HUB_OFFLINE", ""))


def _is_true(setting: str) -> bool:
    return setting.upper() in ("1", "ON", "YES", "TRUE")


@contextlib.contextmanager
def _hub_offline(offline: bool):
    """huggingface_hub as the user set it: it reads HF_HUB_OFFLINE once, at import."""
    from huggingface_hub import constants

    kept = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = offline
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = kept
