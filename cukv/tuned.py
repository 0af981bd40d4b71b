"""The stored autotune winners: ``<compiler.cache_dir()>/autotune.json`` keyed by (device name, dtype, head dim,
page size), read by :func:`lookup` (which ``BatchPrefill`` asks before the documented default) and written by
:func:`save_record` (:mod:`cukv.autotune`, the tuner, calls it). ``CUKV_AUTOTUNE=0`` ignores the file.

``lookup`` needs no GPU and never raises: a missing file means no record; a corrupt file or record is
reported with an :class:`AutotuneWarning` and ignored. Nothing here imports CuPy at import time.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from . import compiler
from .device import device_name  # noqa: F401 - the records' device key (re-exported for autotune)

ENV = "CUKV_AUTOTUNE"
FILE_NAME = "autotune.json"
#: bump when the meaning of a stored record changes (older files are then ignored with a warning)
SCHEMA = 1
FIELDS = ("BM", "BN", "BK", "stages")


class AutotuneWarning(UserWarning):
    """A stored autotune record could not be used (corrupt file, stale record); the default is used."""


# ----------------------------------------------------------------------------------------------
# the store


def autotune_path() -> Path:
    """``<compiler.cache_dir()>/autotune.json`` (follows ``CUKV_CACHE_DIR``)."""
    return compiler.cache_dir() / FILE_NAME


def enabled() -> bool:
    """False when ``CUKV_AUTOTUNE=0``: lookups return None (tuning itself still works)."""
    return os.environ.get(ENV, "").strip() != "0"


def record_key(device: str, dtype: str, head_dim: int, page_size: int) -> str:
    return f"{device}|{dtype}|{int(head_dim)}|{int(page_size)}"


def load_records(path: Path | None = None) -> dict:
    """The stored records by key; ``{}`` when the file is missing, or (with an :class:`AutotuneWarning`)
    unreadable, corrupt or of another schema."""
    path = Path(path) if path is not None else autotune_path()
    if not path.is_file():
        return {}
    problem = None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("records"), dict):
            problem = "not an object with a 'records' object"
        elif data.get("schema") != SCHEMA:
            problem = f"schema {data.get('schema')!r}, this cukv reads {SCHEMA}"
        else:
            return data["records"]
    except (OSError, UnicodeDecodeError, ValueError) as e:
        problem = f"{type(e).__name__}: {e}"
    warnings.warn(f"ignoring the autotune file {path} ({problem}); delete it or re-run "
                  "`python -m cukv autotune prefill`", AutotuneWarning, stacklevel=2)
    return {}


def _config_from_record(rec, dtype: str, head_dim: int, page_size: int):
    from .policy.prefill import tile_config

    cfg = rec["config"]
    vals = [cfg[f] for f in FIELDS]
    return tile_config(dtype, head_dim, page_size, *vals)


def lookup(dtype, head_dim, page_size):
    """The tuned :class:`~cukv.configs.prefill.PrefillConfig` for this GPU, or None (no record, no GPU, or
    ``CUKV_AUTOTUNE=0``). Never raises; a record that no longer forms a valid config is warned about and
    ignored. Touches CuPy only when the file holds a record for this dtype, head dim and page size."""
    try:
        if not enabled():
            return None
        records = load_records()
        if not records:
            return None
        suffix = record_key("", dtype, head_dim, page_size)  # "|dtype|head_dim|page_size"
        if not any(isinstance(k, str) and k.endswith(suffix) for k in records):
            return None
        dev = device_name()
        if dev is None:
            return None
        rec = records.get(record_key(dev, dtype, head_dim, page_size))
        if rec is None:
            return None
        try:
            return _config_from_record(rec, dtype, int(head_dim), int(page_size))
        except (KeyError, TypeError, ValueError) as e:
            warnings.warn(f"ignoring the autotune record {record_key(dev, dtype, head_dim, page_size)!r} in "
                          f"{autotune_path()}: {type(e).__name__}: {e}; re-run `python -m cukv autotune prefill`",
                          AutotuneWarning, stacklevel=2)
            return None
    except Exception as e:  # noqa: BLE001 - a lookup must never break building a kernel
        warnings.warn(f"autotune lookup failed ({type(e).__name__}: {e}); using the default config",
                      AutotuneWarning, stacklevel=2)
        return None


def save_record(config, device: str, **info) -> Path:
    """Store ``config`` as the winner for (device, dtype, head dim, page size); other records are kept.
    The write is atomic (temp file + ``os.replace``) and serialized across processes by a lock file."""
    path = autotune_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    key = record_key(device, config.dtype, config.head_dim, config.page_size)
    rec = {"device": device, "dtype": config.dtype, "head_dim": config.head_dim, "page_size": config.page_size,
           "config": {f: getattr(config, f) for f in FIELDS}, "name": config.name, **info}
    with _locked(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AutotuneWarning)  # a corrupt file is replaced
            records = dict(load_records(path))
        records[key] = rec
        data = {"schema": SCHEMA, "records": dict(sorted(records.items()))}
        compiler._atomic_write(path, (json.dumps(data, indent=1) + "\n").encode())
    return path


class _locked:
    def __init__(self, path: Path):
        self.lock_path = path.with_name(path.name + ".lock")
        self.fd = None

    def __enter__(self):
        try:
            import fcntl

            self.fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except (ImportError, OSError):
            self.fd = None  # no flock here: last writer wins, the file is still never torn
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
