"""Hub downloads and the local model cache.

    path = download("inclusionAI/Ling-3.0-flash-fp4", progress=lambda done, total: ...)
    for m in list_local_models(): print(m.name, m.size, m.weight_format, m.fits)
    remove_model("inclusionAI/Ling-3.0-flash-fp4")

Downloads go through `huggingface_hub.snapshot_download` into the standard HF cache, restricted to what the
engine loads (safetensors, configs, tokenizer, chat template: never pickles or code). Before starting we
check free disk against the repo's file sizes; afterwards every file's size is checked against the Hub's
listing and every safetensors header is parsed, so a truncated or corrupt file is caught here, not at load.

Resuming: finished files stay in the cache and are never fetched again; a connection cut mid-file is
resumed by the hub client with a Range request. (huggingface_hub 2.x deletes a half-written file when
the process is interrupted, so an interrupted file restarts from zero.)

Every failure is a `DownloadError` whose str() is one line for the user.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkchat.engine.checkpoint import parse_header as read_safetensors_header
from sparkchat.engine.errors import DownloadError

# What the engine loads; nothing else is ever downloaded.
ALLOW_PATTERNS = [
    "*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]
# Belt and braces: even if an allow pattern ever matched them, these are refused.
IGNORE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle", "*.py", "*.pyc"]

FP4_RELEASE = "fp4 release (FP8+MXFP4)"
ProgressCallback = Callable[[int, int], None]  # (bytes done, bytes total)

_DTYPE_FORMAT = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64", "F8_E4M3": "fp8",
                 "F8_E5M2": "fp8"}
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


# --- locations ----------------------------------------------------------------------------------------

def hf_cache_dir() -> Path:
    """The HF hub cache, read from the environment now (HF_HUB_CACHE, HF_HOME), not at import time."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return Path(os.path.expandvars(env)).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(os.path.expandvars(home)).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface" / "hub"


def models_dir() -> Path:
    """sparkchat's own models folder (a model is a subfolder holding config.json)."""
    from sparkchat.settings import data_dir

    return data_dir() / "models"


def hub_endpoint(endpoint: str | None = None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


format_bytes = _fmt_bytes


# --- download -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _RemoteFile:
    path: str
    size: int
    blob: str  # the cache blob name: LFS sha256 for LFS files, git blob id otherwise


class _Cancelled(Exception):
    pass


def download(
    repo_id: str,
    revision: str | None = None,
    *,
    offline: bool = False,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    endpoint: str | None = None,
    cache_dir: str | Path | None = None,
    max_workers: int = 8,
) -> Path:
    """Download (or find in the cache) what the engine needs from `repo_id`; returns the snapshot folder.

    `offline=True` or HF_HUB_OFFLINE=1: serve from the cache only, naming any missing files.
    `progress(done, total)` is called from download threads as bytes arrive. Setting `cancel` stops the
    download at the next chunk (DownloadError); Ctrl-C does the same and re-raises KeyboardInterrupt."""
    _check_repo_id(repo_id)
    cache = Path(cache_dir) if cache_dir is not None else hf_cache_dir()
    endpoint = hub_endpoint(endpoint)
    rev = revision or "main"
    if offline or _offline_env():
        return _from_cache(repo_id, rev, cache, reason="offline mode is on")

    _use_timeouts()
    try:
        commit, files = _remote_listing(repo_id, rev, endpoint)
    except _Unreachable as e:
        return _from_cache(repo_id, rev, cache, reason=f"{endpoint} cannot be reached ({e})")

    needed = _check_disk(repo_id, cache, files)
    if progress is not None and needed:
        progress(0, needed)
    box: dict[str, Any] = {}
    stop = cancel or threading.Event()

    def run() -> None:
        try:
            # pinned to the commit we listed, so a push to the branch meanwhile cannot mix versions
            box["path"] = _snapshot(repo_id, commit, endpoint, cache, progress, stop, max_workers, needed)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    # The hub waits for its worker threads before raising; running it in a thread keeps Ctrl-C
    # responsive: we set `stop`, workers raise at their next chunk, and we re-raise here.
    worker = threading.Thread(target=run, name="sparkchat-download", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.2)
    except KeyboardInterrupt:
        stop.set()
        worker.join()
        raise
    if "error" in box:
        raise _as_download_error(box["error"], repo_id, rev, endpoint, cancelled=stop.is_set()) from None

    snapshot = Path(box["path"])
    _verify(repo_id, snapshot, {f.path: f.size for f in files})
    if rev != commit:
        _write_ref(_repo_folder(cache, repo_id), rev, commit)
    return snapshot


def _write_ref(folder: Path, rev: str, commit: str) -> None:
    """refs/<branch or tag> -> commit, as the hub writes it, so offline use finds the snapshot by name."""
    ref = folder / "refs" / rev
    try:
        if ref.is_file() and ref.read_text() == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)
    except OSError:
        pass  # the snapshot is complete; only finding it by branch name offline is lost


def _check_repo_id(repo_id: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+|[A-Za-z0-9][\w.-]*", repo_id) or ".." in repo_id:
        raise DownloadError(f"not a Hub repo id: {repo_id!r} (expected owner/name)")


class _Unreachable(Exception):
    pass


@dataclass(frozen=True)
class HubTimeouts:
    """Seconds a Hub request may wait. huggingface_hub's client has none (its API calls pass timeout=None),
    so a host that accepts the connection and never answers would hang `download` forever."""

    connect: float = 10.0  # to open a connection
    read: float = 60.0  # between two reads: a stall, not a total (a 70 GB file takes what it takes)


TIMEOUTS = HubTimeouts()  # read at each request: tests swap in short ones
_timeouts_installed = False


def _apply_timeouts(request: Any) -> None:
    """An httpx request hook: every Hub request waits TIMEOUTS, whatever its caller passed."""
    t = TIMEOUTS
    request.extensions = {**request.extensions,
                          "timeout": {"connect": t.connect, "read": t.read, "write": t.read, "pool": t.read}}


def _use_timeouts() -> None:
    """huggingface_hub's own client, plus the timeout hook (installed once per process)."""
    global _timeouts_installed
    if _timeouts_installed:
        return
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import default_client_factory

    def factory() -> Any:
        client = default_client_factory()
        hooks = client.event_hooks
        client.event_hooks = {**hooks, "request": [*hooks["request"], _apply_timeouts]}
        return client

    set_client_factory(factory)
    _timeouts_installed = True


def _remote_listing(repo_id: str, rev: str, endpoint: str) -> tuple[str, list[_RemoteFile]]:
    """Resolve the revision and list the files we want, with sizes (one repo_info + one tree call)."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import OfflineModeIsEnabled, filter_repo_objects

    api = HfApi(endpoint=endpoint, library_name="sparkchat")
    try:
        # asked for a commit too: one plain request shows an unreachable host (the tree listing retries)
        commit = api.repo_info(repo_id, revision=rev).sha
        entries = [e for e in api.list_repo_tree(repo_id, revision=commit, recursive=True) if isinstance(e, RepoFile)]
    except (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled) as e:
        raise _Unreachable(_first_line(e)) from None
    except Exception as e:
        raise _as_download_error(e, repo_id, rev, endpoint) from None
    by_path = {e.path: e for e in entries}
    wanted = filter_repo_objects(by_path, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
    files = []
    for path in wanted:
        e = by_path[path]
        size = e.lfs.size if e.lfs is not None else e.size
        files.append(_RemoteFile(path, int(size), e.lfs.sha256 if e.lfs is not None else e.blob_id))
    if not any(f.path.endswith(".safetensors") for f in files):
        raise DownloadError(f"{repo_id} has no safetensors weights (sparkchat never loads pickled weights)")
    return str(commit), files


def _free_disk_bytes(path: Path) -> int:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _check_disk(repo_id: str, cache: Path, files: list[_RemoteFile]) -> int:
    """Refuse when the files still to fetch do not fit on the cache's disk; returns their size."""
    blobs = _repo_folder(cache, repo_id) / "blobs"
    needed = 0
    for f in files:
        blob = blobs / f.blob
        if not (blob.is_file() and blob.stat().st_size == f.size):
            needed += f.size
    free = _free_disk_bytes(cache)
    if needed > free:
        raise DownloadError(
            f"not enough disk space for {repo_id} in {cache}: needs {_fmt_bytes(needed)}, {_fmt_bytes(free)} free"
        )
    return needed


def _snapshot(repo_id: str, commit: str, endpoint: str, cache: Path, progress: ProgressCallback | None,
              stop: threading.Event, max_workers: int, total: int) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(
        repo_id,
        revision=commit,
        cache_dir=str(cache),
        endpoint=endpoint,
        allow_patterns=ALLOW_PATTERNS,
        ignore_patterns=IGNORE_PATTERNS,
        tqdm_class=_progress_class(progress, stop, total),
        max_workers=max_workers,
        library_name="sparkchat",
    )


def _progress_class(progress: ProgressCallback | None, stop: threading.Event, total: int = 0) -> type:
    """A silent tqdm class for snapshot_download: reports its byte bar to `progress`, and raises in the
    download threads once `stop` is set (the hub updates the bar once per chunk).

    The hub grows its bar's total as each file starts; `total` (what the listing says is left to fetch)
    gives the caller the final figure from the start."""
    from tqdm.auto import tqdm

    lock = threading.RLock()
    state: dict[str, Any] = {"bar": None}

    class _Progress(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            desc = str(kwargs.get("desc") or "")
            # snapshot_download makes a file-count bar, a network-bytes bar ("Downloading bytes") and the
            # bytes-written bar we report; older hubs make only the last two or one.
            self._is_bytes = kwargs.get("unit") == "B" and not desc.lower().startswith("downloading bytes")
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            if self._is_bytes:
                state["bar"] = self

        def update(self, n: float | None = 1) -> bool | None:
            if stop.is_set():
                raise _Cancelled()
            with lock:
                self.n += n or 0
                if self._is_bytes and progress is not None and state["bar"] is self:
                    progress(int(self.n), max(int(self.total or 0), total))
            return None

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            return None

        def close(self) -> None:
            if self._is_bytes and progress is not None and state["bar"] is self and not stop.is_set():
                progress(int(self.n), max(int(self.total or 0), total))
            super().close()

    _Progress.set_lock(threading.RLock())
    return _Progress


def _first_line(e: BaseException) -> str:
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()
    return type(e).__name__


def _as_download_error(e: BaseException, repo_id: str, rev: str, endpoint: str,
                       cancelled: bool = False) -> BaseException:
    """Translate whatever the hub raised into one line for the user."""
    if isinstance(e, KeyboardInterrupt):
        return e
    if isinstance(e, _Cancelled) or cancelled:
        return DownloadError(f"download of {repo_id} cancelled; run it again to continue (finished files are kept)")
    if isinstance(e, DownloadError):
        return e
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RemoteEntryNotFoundError,
        RepositoryNotFoundError, RevisionNotFoundError,
    )

    token = bool(os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"))
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, RevisionNotFoundError):
        return DownloadError(f"revision {rev!r} not found in {repo_id}")
    if isinstance(e, GatedRepoError):
        if token:
            return DownloadError(f"{repo_id} is gated and your HF_TOKEN has no access yet: "
                                 f"accept its terms on {endpoint}/{repo_id}")
        return DownloadError(f"{repo_id} is gated or private: accept its terms on {endpoint}/{repo_id} "
                             f"and set HF_TOKEN to a token of that account")
    if status in (401, 403):
        if token:
            return DownloadError(f"{repo_id} is gated or private and HF_TOKEN was refused (HTTP {status}): "
                                 "check the token's read access and the repo name")
        return DownloadError(f"{repo_id} is gated or private, or does not exist (HTTP {status}): "
                             "set HF_TOKEN to a token with access, and check the name")
    if isinstance(e, RepositoryNotFoundError) or status == 404 and not isinstance(e, RemoteEntryNotFoundError):
        return DownloadError(f"model repo {repo_id} not found on {endpoint}")
    if isinstance(e, RemoteEntryNotFoundError):
        return DownloadError(f"a file of {repo_id} vanished from {endpoint} during the download; try again")
    if isinstance(e, HfHubHTTPError):
        return DownloadError(f"download of {repo_id} failed: HTTP {status} from {endpoint}; "
                             "run it again to continue (finished files are kept)")
    if isinstance(e, (httpx2.ConnectError, httpx2.TimeoutException, httpx2.RemoteProtocolError)):
        return DownloadError(f"download of {repo_id} failed: connection to {endpoint} lost ({_first_line(e)}); "
                             "run it again to continue (finished files are kept)")
    if isinstance(e, LocalEntryNotFoundError):
        return DownloadError(f"{repo_id} is not in the cache and {endpoint} cannot be reached")
    if isinstance(e, OSError):
        if getattr(e, "errno", None) == 28:
            return DownloadError(f"disk full while downloading {repo_id}; free some space and run it again")
        return DownloadError(f"download of {repo_id} failed: {_first_line(e)}")
    return DownloadError(f"download of {repo_id} failed: {type(e).__name__}: {_first_line(e)}")


# --- the cache, offline -------------------------------------------------------------------------------

def _from_cache(repo_id: str, rev: str, cache: Path, *, reason: str) -> Path:
    """The cached snapshot for repo@rev, complete and verified, without touching the network."""
    folder = _repo_folder(cache, repo_id)
    commit = rev if _COMMIT.match(rev) else None
    ref = folder / "refs" / rev
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
    snapshot = folder / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        raise DownloadError(f"{repo_id}@{rev} is not in the cache ({cache}) and {reason}: "
                            f"download it once with network access")
    expected = _cached_listing(folder, commit)
    if expected is not None:
        missing = [p for p in expected if not (snapshot / p).is_file()]
    else:  # no listing cached: at least what the engine cannot do without
        missing = [p for p in ("config.json",) if not (snapshot / p).is_file()]
        if not list(snapshot.glob("*.safetensors")) and not (snapshot / "model.safetensors.index.json").is_file():
            missing.append("*.safetensors")
    missing += [p for p in _index_shards(snapshot) if not (snapshot / p).is_file() and p not in missing]
    if missing:
        raise DownloadError(f"{repo_id}@{rev} is incomplete in the cache and {reason}: "
                            f"missing {', '.join(sorted(missing))}")
    _verify(repo_id, snapshot, expected or {})
    return snapshot


def _cached_listing(folder: Path, commit: str) -> dict[str, int] | None:
    """{path: size} of the files we want, from the tree listing the hub cached at download time."""
    try:
        data = json.loads((folder / "trees" / f"{commit}.json").read_text())
        files = data["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    from huggingface_hub.utils import filter_repo_objects

    wanted = filter_repo_objects(files, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
    out = {}
    for p in wanted:
        info = files[p]
        out[p] = int(info.get("lfs_size") or info.get("size") or 0)
    return out


def _index_shards(snapshot: Path) -> list[str]:
    idx = snapshot / "model.safetensors.index.json"
    if not idx.is_file():
        return []
    try:
        weight_map = json.loads(idx.read_text()).get("weight_map", {})
        return sorted(set(weight_map.values()))
    except (OSError, ValueError, AttributeError):
        raise DownloadError(f"{idx.name} in {snapshot} is not valid JSON") from None


# --- verification -------------------------------------------------------------------------------------

def _verify(repo_id: str, snapshot: Path, expected: dict[str, int]) -> None:
    """Sizes against the Hub's listing, then every safetensors header. A bad file is removed from the
    cache (so the next download fetches it afresh) and reported in one line."""
    problems: list[tuple[str, str]] = []
    for rel, size in sorted(expected.items()):
        p = snapshot / rel
        if p.is_file() and p.stat().st_size != size:
            problems.append((rel, f"is {p.stat().st_size} bytes, expected {size}"))
    bad = {rel for rel, _ in problems}
    for p in sorted(snapshot.rglob("*.safetensors")):
        rel = p.relative_to(snapshot).as_posix()
        if rel in bad:
            continue
        try:
            read_safetensors_header(p)
        except (ValueError, OSError) as e:
            problems.append((rel, f"is corrupt ({e})"))
    if not problems:
        return
    for rel, _ in problems:
        _remove_cached_file(snapshot / rel)
    rel, why = problems[0]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise DownloadError(f"{rel} of {repo_id} {why}{more}: removed it from the cache, download again to refetch")


def _remove_cached_file(pointer: Path) -> None:
    try:
        target = pointer.resolve()
        pointer.unlink(missing_ok=True)
        if target != pointer and target.parent.name == "blobs":
            target.unlink(missing_ok=True)
    except OSError:
        pass


# --- local models -------------------------------------------------------------------------------------

@dataclass
class LocalModel:
    name: str  # repo id (HF cache) or folder name (sparkchat models dir); "@commit" for non-current snapshots
    path: Path  # the folder the engine loads
    size: int  # bytes on disk
    weight_format: str  # "bf16", FP4_RELEASE, "fp8", "fp16", ..., or "unknown"
    resident_bytes: int  # estimate of memory needed to run it
    available_bytes: int  # memory available on this machine now
    source: str  # "hf-cache" or "sparkchat"
    revision: str | None = None  # commit hash for HF cache snapshots
    has_mtp: bool | None = None

    @property
    def fits(self) -> bool:
        return self.resident_bytes <= self.available_bytes


def list_local_models(*, available_bytes: int | None = None, cache_dir: str | Path | None = None,
                      extra_dirs: Iterable[str | Path] | None = None) -> list[LocalModel]:
    """Models in the HF cache and in sparkchat's models dir, sorted by name.

    Only folders with a config.json are listed. `available_bytes` overrides the memory probe (tests)."""
    if available_bytes is None:
        from sparkchat.engine.capabilities import available_memory_bytes

        available_bytes = available_memory_bytes()
    found: list[LocalModel] = []
    cache = Path(cache_dir) if cache_dir is not None else hf_cache_dir()
    for repo_id, commit, snapshot, current in _cache_snapshots(cache):
        name = repo_id if current else f"{repo_id}@{commit[:8]}"
        found.append(_describe(name, snapshot, "hf-cache", available_bytes, commit))
    dirs = [models_dir(), *(Path(d) for d in (extra_dirs or []))]
    for base in dirs:
        for folder in _model_folders(base):
            found.append(_describe(folder.relative_to(base).as_posix(), folder, "sparkchat", available_bytes))
    return sorted(found, key=lambda m: (m.name.lower(), m.source))


def _cache_snapshots(cache: Path) -> list[tuple[str, str, Path, bool]]:
    """(repo_id, commit, snapshot folder, is a ref's current commit) for model repos in the HF cache."""
    out = []
    if not cache.is_dir():
        return out
    for folder in sorted(cache.glob("models--*")):
        repo_id = folder.name[len("models--"):].replace("--", "/")
        refs = set()
        for ref in (folder / "refs").glob("**/*"):
            if ref.is_file():
                try:
                    refs.add(ref.read_text().strip())
                except OSError:
                    pass
        snaps = sorted(p for p in (folder / "snapshots").glob("*") if p.is_dir() and (p / "config.json").is_file())
        for snap in snaps:
            current = snap.name in refs or len(snaps) == 1
            out.append((repo_id, snap.name, snap, current))
    return out


def _model_folders(base: Path) -> list[Path]:
    """Folders holding config.json, one or two levels under `base` (name or owner/name)."""
    if not base.is_dir():
        return []
    out = []
    for child in sorted(base.iterdir()):
        if not child.is_dir():
            continue
        if (child / "config.json").is_file():
            out.append(child)
        else:
            out += [g for g in sorted(child.iterdir()) if g.is_dir() and (g / "config.json").is_file()]
    return out


def _describe(name: str, folder: Path, source: str, available: int, commit: str | None = None) -> LocalModel:
    size = _folder_bytes(folder)
    weights = sum(p.stat().st_size for p in folder.rglob("*.safetensors") if p.is_file())
    config = _read_json(folder / "config.json")
    fmt = weight_format(folder, config)
    mtp = None
    if config is not None:
        layers = config.get("num_nextn_predict_layers", config.get("num_mtp_layers"))
        mtp = bool(layers) if layers is not None else False
    return LocalModel(name=name, path=folder, size=size, weight_format=fmt, resident_bytes=resident_estimate(weights),
                      available_bytes=int(available), source=source, revision=commit, has_mtp=mtp)


def resident_estimate(weight_bytes: int) -> int:
    """Weights stay in their stored precision; add room for caches, activations and the CUDA context."""
    return weight_bytes + max(1 << 30, weight_bytes // 32)


def _folder_bytes(folder: Path) -> int:
    seen: set[Path] = set()
    total = 0
    for p in folder.rglob("*"):
        try:
            real = p.resolve()
            if real in seen or not real.is_file():
                continue
            seen.add(real)
            total += real.stat().st_size
        except OSError:
            continue
    return total


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def weight_format(folder: str | Path, config: dict[str, Any] | None = None) -> str:
    """ "bf16", FP4_RELEASE, "fp8", "fp16", another quant_method, or "unknown", from config.json's
    quantization_config and, without one, from the dtypes in the safetensors headers."""
    folder = Path(folder)
    if config is None:
        config = _read_json(folder / "config.json") or {}
    q = config.get("quantization_config")
    if isinstance(q, dict) and q:
        method = str(q.get("quant_method", "")).lower()
        if method == "fp8" and str(q.get("routed_experts_quant_method", "")).lower() == "mxfp4":
            return FP4_RELEASE
        return method or "quantized"
    counts: dict[str, int] = {}
    for p in sorted(folder.rglob("*.safetensors")):
        try:
            header = read_safetensors_header(p)
        except (ValueError, OSError):
            continue
        for name, t in header.items():
            if name != "__metadata__":
                lo, hi = t["data_offsets"]
                counts[t["dtype"]] = counts.get(t["dtype"], 0) + hi - lo
    if not counts:
        return "unknown"
    dtype = max(counts, key=lambda k: counts[k])
    return _DTYPE_FORMAT.get(dtype, dtype.lower())


def find_local_model(name_or_path: str | Path, models: list[LocalModel] | None = None) -> LocalModel | None:
    """A listed local model by name (repo id, folder name, name@commit) or by its path."""
    models = models if models is not None else list_local_models(available_bytes=0)
    key = str(name_or_path)
    for m in models:
        if m.name == key:
            return m
    try:
        target = Path(key).expanduser().resolve()
    except OSError:
        return None
    for m in models:
        if m.path.resolve() == target:
            return m
    matches = [m for m in models if m.name.split("@")[0] == key]
    return matches[0] if len(matches) == 1 else None


def remove_model(name_or_path: str | Path) -> tuple[LocalModel, int]:
    """Delete a local model sparkchat knows about; returns it and the bytes freed.

    For an HF cache snapshot, blobs still used by another snapshot of the same repo are kept."""
    m = find_local_model(name_or_path)
    if m is None:
        raise DownloadError(f"no local model named {str(name_or_path)!r}: `sparkchat models` lists them")
    if m.source == "sparkchat":
        freed = _folder_bytes(m.path)
        _rmtree(m.path)
        return m, freed
    snapshot = m.path
    repo_folder = snapshot.parent.parent
    others = [p for p in (repo_folder / "snapshots").iterdir() if p.is_dir() and p != snapshot]
    if not others:
        freed = _folder_bytes(repo_folder)
        _rmtree(repo_folder)
        shutil.rmtree(repo_folder.parent / ".locks" / repo_folder.name, ignore_errors=True)
        return m, freed
    keep = {p.resolve() for o in others for p in o.rglob("*") if p.is_symlink() or p.is_file()}
    freed = 0
    for p in snapshot.rglob("*"):
        real = p.resolve()
        if real.parent.name == "blobs" and real not in keep and real.is_file():
            freed += real.stat().st_size
            real.unlink()
    _rmtree(snapshot)
    for ref in (repo_folder / "refs").glob("**/*"):
        if ref.is_file() and ref.read_text().strip() == snapshot.name:
            ref.unlink()
    return m, freed


def _rmtree(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except OSError as e:
        raise DownloadError(f"cannot remove {path}: {e.strerror or e}") from None


def resolve_model(name_or_path: str | Path) -> Path:
    """The folder to load for a setting like `model = ...`: an existing folder, or a local model's path."""
    p = Path(name_or_path).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return p
    from sparkchat.engine.errors import ModelError

    m = find_local_model(name_or_path)
    if m is None:
        raise ModelError(f"model {str(name_or_path)!r} is not here: `sparkchat download {name_or_path}` "
                         "fetches a Hub repo, `sparkchat models` lists local ones")
    return m.path
