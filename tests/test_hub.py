"""sparkchat.hub against a real local HTTP server speaking the Hub API (tests/hub_server.py). Offline, fast."""

from __future__ import annotations

import _thread
import json
import signal
import struct
import threading
from pathlib import Path

import pytest

from sparkchat import hub
from sparkchat.engine.errors import DownloadError
from tests.hub_server import FakeHub, FakeRepo, make_safetensors, serve_fake_hub, tiny_model_files

REPO = "org/tiny"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
WANTED = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "model.safetensors.index.json", SHARD1, SHARD2}
NEVER = {"pytorch_model.bin", "training_args.pt", "optimizer.pth", "model.ckpt", "modeling_bailing.py"}


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    server = serve_fake_hub(tmp_path, monkeypatch, {REPO: FakeRepo(tiny_model_files())})
    yield server
    server.stop()


def cache(tmp_path: Path) -> Path:
    return tmp_path / "hf" / "hub"


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg and "Traceback" not in msg
    return msg


def requested(server: FakeHub) -> set[str]:
    return {p.rsplit("/", 1)[-1] for m, p, _ in server.log if "/resolve/" in p}


def test_full_download_reports_bytes_up_to_total(fake: FakeHub, tmp_path: Path):
    events: list[tuple[int, int]] = []
    path = hub.download(REPO, progress=lambda done, total: events.append((done, total)))

    files = tiny_model_files()
    assert path.is_dir() and path.is_relative_to(cache(tmp_path))
    assert {p.name for p in path.iterdir()} == WANTED
    for name in WANTED:
        assert (path / name).read_bytes() == files[name]
    total = sum(len(files[n]) for n in WANTED)
    assert events, "no progress reported"
    assert events[-1] == (total, total)
    dones = [d for d, _ in events]
    assert dones == sorted(dones)


def test_pickles_and_code_never_requested(fake: FakeHub):
    path = hub.download(REPO)
    asked = requested(fake)
    assert asked == WANTED
    assert not asked & NEVER and "README.md" not in asked
    assert not any((path / n).exists() for n in NEVER)


def test_second_download_fetches_nothing(fake: FakeHub):
    hub.download(REPO)
    fake.log.clear()
    hub.download(REPO)
    assert not [h for m, p, h in fake.log if m == "GET" and "/resolve/" in p]


def test_connection_cut_midway_is_resumed_with_range(fake: FakeHub, monkeypatch: pytest.MonkeyPatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "DOWNLOAD_CHUNK_SIZE", 512)  # several chunks per tiny file
    fake.cut_after[SHARD1] = 1500
    events: list[tuple[int, int]] = []
    path = hub.download(REPO, progress=lambda d, t: events.append((d, t)))

    gets = fake.gets(SHARD1)
    assert len(gets) == 2, gets
    assert "range" not in gets[0]
    start = int(gets[1]["range"].removeprefix("bytes=").rstrip("-"))
    assert 0 < start <= 1500
    assert (path / SHARD1).read_bytes() == tiny_model_files()[SHARD1]
    assert events[-1][0] == events[-1][1]


def test_interrupted_download_continues_on_next_call(fake: FakeHub, tmp_path: Path):
    fake.cut_after[SHARD1] = 700
    fake.down_after_cut = True  # the retry fails too: the first call gives up
    with pytest.raises(DownloadError) as e:
        hub.download(REPO)
    assert "again" in one_line(e)

    blobs = cache(tmp_path) / "models--org--tiny" / "blobs"
    assert len([b for b in blobs.iterdir() if not b.name.endswith(".incomplete")]) == len(WANTED) - 1
    fake.reset()
    fake.log.clear()
    path = hub.download(REPO)
    assert {p.rsplit("/", 1)[-1] for m, p, _ in fake.log if m == "GET" and "/resolve/" in p} == {SHARD1}
    files = tiny_model_files()
    for name in WANTED:
        assert (path / name).read_bytes() == files[name]


def test_cancel_event_stops_download(fake: FakeHub, monkeypatch: pytest.MonkeyPatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "DOWNLOAD_CHUNK_SIZE", 256)
    cancel = threading.Event()
    with pytest.raises(DownloadError) as e:
        hub.download(REPO, progress=lambda d, t: cancel.set(), cancel=cancel, max_workers=1)
    assert "cancelled" in one_line(e)
    fake.log.clear()
    assert (hub.download(REPO) / SHARD2).is_file()


def test_ctrl_c_stops_workers_and_reraises(fake: FakeHub, monkeypatch: pytest.MonkeyPatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "DOWNLOAD_CHUNK_SIZE", 256)
    fired = threading.Event()

    def interrupt(done: int, total: int) -> None:
        if not fired.is_set():
            fired.set()
            _thread.interrupt_main()  # what Ctrl-C does, raised in the main thread

    # interrupt_main does nothing while SIGINT is ignored or at its C default; an earlier test in the
    # same process (the apps' event loops) may have left it so: put Python's own handler back
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = threading.active_count()
    try:
        with pytest.raises(KeyboardInterrupt):
            hub.download(REPO, progress=interrupt)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert threading.active_count() <= before + 1  # the download thread and its workers are gone
    assert not any(t.name == "sparkchat-download" for t in threading.enumerate())


@pytest.mark.parametrize("mode, words", [("header", "corrupt"), ("truncate", "expected")])
def test_corrupt_file_is_named_removed_and_refetched(fake: FakeHub, mode: str, words: str):
    fake.corrupt[SHARD2] = mode
    with pytest.raises(DownloadError) as e:
        hub.download(REPO)
    msg = one_line(e)
    assert SHARD2 in msg and words in msg and SHARD1 not in msg

    fake.reset()
    path = hub.download(REPO)
    assert (path / SHARD2).read_bytes() == tiny_model_files()[SHARD2]


def test_offline_serves_from_cache_without_network(fake: FakeHub, monkeypatch: pytest.MonkeyPatch):
    first = hub.download(REPO)
    fake.log.clear()
    assert hub.download(REPO, offline=True) == first
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.download(REPO) == first
    assert fake.log == []


def test_unreachable_hub_falls_back_to_cache(fake: FakeHub):
    first = hub.download(REPO)
    fake.stop()
    assert hub.download(REPO) == first


def test_unreachable_hub_and_nothing_cached(fake: FakeHub):
    fake.stop()
    with pytest.raises(DownloadError) as e:
        hub.download(REPO)
    msg = one_line(e)
    assert "not in the cache" in msg and "cannot be reached" in msg


def test_offline_names_missing_files(fake: FakeHub):
    path = hub.download(REPO)
    (path / SHARD2).unlink()
    (path / "tokenizer.json").unlink()
    with pytest.raises(DownloadError) as e:
        hub.download(REPO, offline=True)
    msg = one_line(e)
    assert SHARD2 in msg and "tokenizer.json" in msg and SHARD1 not in msg


def test_offline_without_cache_says_so(fake: FakeHub):
    with pytest.raises(DownloadError) as e:
        hub.download(REPO, offline=True)
    assert "not in the cache" in one_line(e)
    assert fake.log == []


def test_offline_detects_corrupt_cached_file(fake: FakeHub):
    path = hub.download(REPO)
    blob = (path / SHARD1).resolve()
    data = blob.read_bytes()
    blob.write_bytes(data[: len(data) - 100])  # a disk problem after the download
    with pytest.raises(DownloadError) as e:
        hub.download(REPO, offline=True)
    assert SHARD1 in one_line(e)


def test_missing_repo_is_one_line(fake: FakeHub):
    with pytest.raises(DownloadError) as e:
        hub.download("org/nope")
    msg = one_line(e)
    assert "org/nope" in msg and "not found" in msg


def test_missing_revision_is_one_line(fake: FakeHub):
    with pytest.raises(DownloadError) as e:
        hub.download(REPO, "v9")
    assert "'v9'" in one_line(e)


def test_token_required(fake: FakeHub, monkeypatch: pytest.MonkeyPatch):
    fake.token = "hf_secret"
    with pytest.raises(DownloadError) as e:
        hub.download(REPO)
    msg = one_line(e)
    assert "HF_TOKEN" in msg and "gated or private" in msg

    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    path = hub.download(REPO)
    assert (path / SHARD1).is_file()
    assert all(h.get("authorization") == "Bearer hf_secret" for _, _, h in fake.log[-3:])


def test_wrong_token_and_gated_repo(fake: FakeHub, monkeypatch: pytest.MonkeyPatch):
    fake.token = "hf_secret"
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(DownloadError) as e:
        hub.download(REPO)
    assert "HF_TOKEN was refused" in one_line(e)
    fake.gated = True
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(DownloadError) as e:
        hub.download(REPO)
    msg = one_line(e)
    assert "gated" in msg and "accept its terms" in msg and "HF_TOKEN" in msg


def test_disk_space_checked_before_downloading(fake: FakeHub, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(hub, "_free_disk_bytes", lambda path: 1000)
    with pytest.raises(DownloadError) as e:
        hub.download(REPO)
    msg = one_line(e)
    assert "disk space" in msg and "needs 9.1 kB" in msg and "1.0 kB free" in msg
    assert requested(fake) == set()


def test_disk_check_counts_only_missing_files(fake: FakeHub, monkeypatch: pytest.MonkeyPatch):
    path = hub.download(REPO)
    (path / SHARD2).resolve().unlink()
    (path / SHARD2).unlink()
    need = len(tiny_model_files()[SHARD2])
    monkeypatch.setattr(hub, "_free_disk_bytes", lambda p: need)
    assert hub.download(REPO) == path


def test_repo_without_safetensors_refused(fake: FakeHub):
    fake.repos["org/pickles"] = FakeRepo({"config.json": b"{}", "pytorch_model.bin": b"x" * 10})
    with pytest.raises(DownloadError) as e:
        hub.download("org/pickles")
    assert "safetensors" in one_line(e)
    assert requested(fake) == set()


# --- safetensors header checks ---

def test_header_parses(tmp_path: Path):
    p = tmp_path / "a.safetensors"
    p.write_bytes(make_safetensors({"w": ("F32", [2, 3], b"\0" * 24)}))
    assert hub.read_safetensors_header(p)["w"]["shape"] == [2, 3]


@pytest.mark.parametrize("damage, words", [
    (lambda b: b[:-1], "truncated"),
    (lambda b: b[:5], "too short"),
    (lambda b: struct.pack("<Q", 10**9) + b[8:], "header length"),
    (lambda b: b[:8] + b"\xff" * (len(b) - 8), "JSON"),
])
def test_header_damage_detected(tmp_path: Path, damage, words: str):
    p = tmp_path / "a.safetensors"
    p.write_bytes(damage(make_safetensors({"w": ("F32", [2, 3], b"\0" * 24)})))
    with pytest.raises(ValueError, match=words):
        hub.read_safetensors_header(p)


def test_header_size_mismatch_detected(tmp_path: Path):
    p = tmp_path / "a.safetensors"
    p.write_bytes(make_safetensors({"w": ("F32", [2, 4], b"\0" * 24)}))
    with pytest.raises(ValueError, match="shape"):
        hub.read_safetensors_header(p)


# --- local models ---

def _write_model(folder: Path, config: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(make_safetensors(tensors))
    return folder


def test_list_local_models_from_cache_and_models_dir(fake: FakeHub, tmp_path: Path):
    hub.download(REPO)
    release = {"quantization_config": {"quant_method": "fp8", "routed_experts_quant_method": "mxfp4"},
               "num_nextn_predict_layers": 1}
    _write_model(hub.models_dir() / "ling-fp4", release, {"w": ("U8", [4], b"\0" * 4)})
    _write_model(hub.models_dir() / "me" / "f16", {}, {"w": ("F16", [4], b"\0" * 8)})
    (hub.models_dir() / "not-a-model").mkdir()

    models = {m.name: m for m in hub.list_local_models(available_bytes=2 << 30)}
    assert set(models) == {REPO, "ling-fp4", "me/f16"}
    tiny = models[REPO]
    assert tiny.source == "hf-cache" and tiny.weight_format == "bf16" and tiny.has_mtp
    assert tiny.size == sum(len(tiny_model_files()[n]) for n in WANTED)
    assert tiny.fits
    assert models["ling-fp4"].weight_format == hub.FP4_RELEASE
    assert models["me/f16"].weight_format == "fp16" and models["me/f16"].has_mtp is False

    small = {m.name: m for m in hub.list_local_models(available_bytes=1 << 20)}
    assert not small[REPO].fits


def test_weight_format_from_quant_config(tmp_path: Path):
    m = _write_model(tmp_path / "m", {"quantization_config": {"quant_method": "fp8"}}, {"w": ("F8_E4M3", [4], b"\0" * 4)})
    assert hub.weight_format(m) == "fp8"


def test_remove_model(fake: FakeHub, tmp_path: Path):
    hub.download(REPO)
    own = _write_model(hub.models_dir() / "mine", {}, {"w": ("BF16", [4], b"\0" * 8)})
    removed, freed = hub.remove_model(REPO)
    assert removed.name == REPO and freed > 8000
    assert not (cache(tmp_path) / "models--org--tiny").exists()
    removed, _ = hub.remove_model(str(own))
    assert removed.name == "mine" and not own.exists()
    with pytest.raises(DownloadError) as e:
        hub.remove_model("org/tiny")
    assert "no local model" in one_line(e)


def test_remove_model_refuses_unknown_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPARKCHAT_DATA_DIR", str(tmp_path / "data"))
    stray = _write_model(tmp_path / "elsewhere", {}, {"w": ("BF16", [4], b"\0" * 8)})
    with pytest.raises(DownloadError):
        hub.remove_model(str(stray))
    assert stray.exists()


def test_resolve_model(fake: FakeHub, tmp_path: Path):
    from sparkchat.engine.errors import ModelError

    with pytest.raises(ModelError) as e:
        hub.resolve_model(REPO)
    assert "sparkchat download org/tiny" in one_line(e)
    path = hub.download(REPO)
    assert hub.resolve_model(REPO) == path
    assert hub.resolve_model(str(path)) == path


class SilentHost:
    """Accepts connections and never answers (a hung proxy or server); holds them until stopped."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed by stop()
                return
            self.held.append(conn)

    def stop(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.mark.parametrize("revision", [None, "0123456789abcdef0123456789abcdef01234567"])
def test_host_that_never_answers_is_a_clean_error(fake: FakeHub, monkeypatch: pytest.MonkeyPatch, revision):
    import time

    import huggingface_hub.constants as hc

    silent = SilentHost()
    monkeypatch.setenv("HF_ENDPOINT", silent.url)
    monkeypatch.setattr(hc, "ENDPOINT", silent.url)
    monkeypatch.setattr(hub, "TIMEOUTS", hub.HubTimeouts(connect=1.0, read=1.0))
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            hub.download(REPO, revision=revision)
        except BaseException as e:  # noqa: BLE001 (checked below)
            box["error"] = e

    t0 = time.monotonic()
    worker = threading.Thread(target=run, daemon=True)  # a hang fails the test instead of hanging it
    worker.start()
    worker.join(10)
    silent.stop()
    assert not worker.is_alive(), "download still waiting on a host that never answers"
    assert time.monotonic() - t0 < 5
    e = box.get("error")
    assert isinstance(e, DownloadError), repr(e)
    msg = str(e)
    assert "\n" not in msg and "cannot be reached" in msg and silent.url in msg and "timed out" in msg


def test_hub_requests_wait_connect_then_read_timeouts(monkeypatch: pytest.MonkeyPatch):
    """A stall limit per read, not a total: a big file may take hours."""
    import httpx2

    monkeypatch.setattr(hub, "TIMEOUTS", hub.HubTimeouts())
    request = httpx2.Request("GET", "http://127.0.0.1/x", extensions={"timeout": httpx2.Timeout(None).as_dict()})
    hub._apply_timeouts(request)
    assert request.extensions["timeout"] == {"connect": 10.0, "read": 60.0, "write": 60.0, "pool": 60.0}
