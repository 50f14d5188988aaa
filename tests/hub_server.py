"""A real HTTP server on 127.0.0.1 that speaks the part of the Hub API `snapshot_download` uses.

Endpoints (as huggingface_hub 2.x calls them):
  GET  /api/models/{repo}/revision/{rev}         repo info (its `sha` resolves the revision)
  GET  /api/models/{repo}/tree/{rev}?recursive=  file listing with sizes (LFS files carry `lfs`)
  HEAD /{repo}/resolve/{rev}/{path}              ETag, X-Repo-Commit, Content-Length
  GET  /{repo}/resolve/{rev}/{path}              the bytes; honours `Range: bytes=a-[b]` with 206

No X-Xet-* headers and no `xetHash`, so the client uses plain HTTP. Switches (attributes of FakeHub):
  cut_after[path] = n   send n bytes of the body (promising all of it) then drop the connection, once
  down_after_cut        after a cut, answer 503 to GETs of that file until `reset()`
  corrupt[path] = mode  "header": same size, garbage header; "truncate": serve (and HEAD) fewer bytes
                        than the listing says
  token                 require `Authorization: Bearer <token>`, else 401
  gated                 with token: the 401 says X-Error-Code: GatedRepo
Unknown repos get 404 with X-Error-Code: RepoNotFound, like the Hub.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def make_safetensors(tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """A valid safetensors file from {name: (dtype, shape, raw bytes)}."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(raw for _, _, raw in tensors.values())


def tiny_model_files() -> dict[str, bytes]:
    """A tiny model repo: two bf16 shards with an index, configs, tokenizer — and files we must never fetch."""
    shard1 = make_safetensors({
        "model.word_embeddings.weight": ("BF16", [64, 32], bytes(range(256)) * 16),
        "model.norm.weight": ("BF16", [32], b"\x80\x3f" * 32),
    })
    shard2 = make_safetensors({"lm_head.weight": ("BF16", [64, 32], bytes(range(255, -1, -1)) * 16)})
    index = {"metadata": {"total_size": 4096 + 64 + 4096},
             "weight_map": {"model.word_embeddings.weight": "model-00001-of-00002.safetensors",
                            "model.norm.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    config = {"model_type": "bailing_hybrid", "hidden_size": 32, "vocab_size": 64, "num_hidden_layers": 1,
              "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}
    return {
        "config.json": json.dumps(config).encode(),
        "generation_config.json": b'{"eos_token_id": 1}',
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}).encode(),
        "tokenizer_config.json": b'{"model_max_length": 128}',
        "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": shard1,
        "model-00002-of-00002.safetensors": shard2,
        # never downloaded:
        "pytorch_model.bin": b"PICKLE" * 100,
        "training_args.pt": b"PICKLE" * 10,
        "optimizer.pth": b"PICKLE" * 10,
        "model.ckpt": b"PICKLE" * 10,
        "modeling_bailing.py": b"import os\nos.system('echo pwned')\n",
        "README.md": b"# tiny\n",
        ".gitattributes": b"*.safetensors filter=lfs\n",
    }


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    cut_after: dict[str, int] = field(default_factory=dict)
    down_after_cut: bool = False
    corrupt: dict[str, str] = field(default_factory=dict)
    token: str | None = None
    gated: bool = False  # with `token`: refuse like a gated repo (401 + X-Error-Code: GatedRepo)
    log: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    _down: set[str] = field(default_factory=set)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def reset(self) -> None:
        """Clear every switch (not the repos or the log)."""
        self.cut_after.clear()
        self.corrupt.clear()
        self._down.clear()
        self.down_after_cut = False
        self.token = None
        self.gated = False

    def gets(self, path: str) -> list[dict[str, str]]:
        """Headers of every GET of a file (by repo path), in order."""
        return [h for m, p, h in self.log if m == "GET" and "/resolve/" in p and p.endswith("/" + path)]

    # what a file looks like on the wire, switches applied
    def served_bytes(self, path: str, data: bytes) -> bytes:
        mode = self.corrupt.get(path)
        if mode == "truncate":
            return data[: len(data) * 2 // 3]
        if mode == "header":
            return struct.pack("<Q", 2**40) + data[8:]
        return data


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def do_HEAD(self) -> None:
        self._handle(head=True)

    def do_GET(self) -> None:
        self._handle(head=False)

    # -- helpers
    def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, obj, head: bool = False) -> None:
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, head)

    def _error(self, code: int, error_code: str | None, message: str, head: bool) -> None:
        headers = {"X-Error-Message": message}
        if error_code:
            headers["X-Error-Code"] = error_code
        body = b"" if head else json.dumps({"error": message}).encode()
        self._send(code, body, headers, head)

    def _handle(self, head: bool) -> None:
        fake = self.fake
        url = urlsplit(self.path)
        path = unquote(url.path)
        with fake._lock:
            fake.log.append(("HEAD" if head else "GET", path, {k.lower(): v for k, v in self.headers.items()}))
        if fake.token is not None and self.headers.get("authorization") != f"Bearer {fake.token}":
            if fake.gated:
                return self._error(401, "GatedRepo", "Access to this model is restricted.", head)
            return self._error(401, None, "Invalid username or password.", head)

        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo_id, kind, rev = "/".join(parts[2:4]), parts[4], parts[5]
            repo = fake.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found", head)
            if rev not in ("main", repo.sha):
                return self._error(404, "RevisionNotFound", "Invalid rev id: " + rev, head)
            if kind == "revision":
                return self._json({"id": repo_id, "sha": repo.sha, "private": False,
                                   "siblings": [{"rfilename": f} for f in repo.files]}, head)
            if kind == "tree":
                return self._json([self._tree_entry(p, d) for p, d in sorted(repo.files.items())], head)
            return self._error(404, None, "not found", head)

        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, rev, file = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            repo = fake.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found", head)
            if rev not in ("main", repo.sha):
                return self._error(404, "RevisionNotFound", "Invalid rev id: " + rev, head)
            if file not in repo.files:
                return self._error(404, "EntryNotFound", "Entry not found", head)
            return self._serve_file(repo, file, head)
        return self._error(404, None, "not found", head)

    def _tree_entry(self, path: str, data: bytes) -> dict:
        entry = {"type": "file", "path": path, "size": len(data), "oid": _git_blob_id(data)}
        if path.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def _serve_file(self, repo: FakeRepo, file: str, head: bool) -> None:
        fake = self.fake
        original = repo.files[file]
        data = fake.served_bytes(file, original)
        etag = hashlib.sha256(original).hexdigest() if file.endswith(LFS_SUFFIXES) else _git_blob_id(original)
        headers = {"ETag": f'"{etag}"', "X-Repo-Commit": repo.sha, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if head:
            return self._send(200, data, headers, head=True)
        if file in fake._down:
            return self._error(503, None, "Service Unavailable", head=False)

        start, code = 0, 200
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            lo, _, hi = rng[len("bytes="):].partition("-")
            start = int(lo)
            end = int(hi) if hi else len(data) - 1
            if start >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            body = data[start : end + 1]
            headers["Content-Range"] = f"bytes {start}-{start + len(body) - 1}/{len(data)}"
            code = 206
        else:
            body = data

        cut = fake.cut_after.pop(file, None)
        if cut is not None:
            # promise the whole body, send part of it, drop the connection
            if fake.down_after_cut:
                fake._down.add(file)
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            return
        self._send(code, body, headers)


def serve_fake_hub(tmp_path, monkeypatch, repos: dict[str, FakeRepo]) -> FakeHub:
    """Start a FakeHub and point everything at it: HF_ENDPOINT, huggingface_hub's import-time constants,
    a fresh HF cache and sparkchat dirs under tmp_path, no token; DNS for anything but localhost fails,
    so a test can never reach the real Hub. The caller stops the server."""
    import socket

    import huggingface_hub.constants as hc

    server = FakeHub(repos=repos).start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("SPARKCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SPARKCHAT_CONFIG_DIR", str(tmp_path / "config"))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    # read by huggingface_hub at import time
    monkeypatch.setattr(hc, "ENDPOINT", server.url)
    monkeypatch.setattr(hc, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hc, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hc, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    monkeypatch.setattr(hc, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf" / "stored_tokens"))
    real_getaddrinfo = socket.getaddrinfo

    def local_only(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise socket.gaierror(f"tests may not resolve {host}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", local_only)
    return server
