"""Conversations in SQLite: several chats, resumable, searchable, exportable.

One file (`history.db` in the data dir), WAL mode so several app instances can read while one writes,
every write in a `BEGIN IMMEDIATE` transaction with a busy timeout so concurrent writers queue instead
of failing. An answer is saved while it streams (status 'streaming'); rows left 'streaming' by a
process that is gone (crash, Ctrl-C) are marked 'interrupted' when the history is next opened.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sparkchat.engine.errors import SparkchatError
from sparkchat.settings import data_dir

SCHEMA_VERSION = 1
STATUSES = ("complete", "interrupted", "streaming")
ROLES = ("system", "user", "assistant")
BUSY_TIMEOUT_MS = 10_000

_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS conversations (
        id        INTEGER PRIMARY KEY,
        title     TEXT NOT NULL,
        created   REAL NOT NULL,
        updated   REAL NOT NULL,
        model     TEXT,
        settings  TEXT NOT NULL DEFAULT '{}'
    )""",
    """CREATE TABLE IF NOT EXISTS messages (
        id              INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role            TEXT NOT NULL,
        content         TEXT NOT NULL DEFAULT '',
        stats           TEXT,
        status          TEXT NOT NULL DEFAULT 'complete',
        created         REAL NOT NULL,
        writer          TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id)",
    "CREATE INDEX IF NOT EXISTS conversations_by_updated ON conversations(updated DESC, id DESC)",
]

# External-content FTS5 index over messages.content, kept in step by triggers.
_FTS_SCHEMA = [
    "CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(content, content='messages', content_rowid='id')",
    """CREATE TRIGGER IF NOT EXISTS messages_fts_ai AFTER INSERT ON messages BEGIN
        INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
    END""",
    """CREATE TRIGGER IF NOT EXISTS messages_fts_ad AFTER DELETE ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
    END""",
    """CREATE TRIGGER IF NOT EXISTS messages_fts_au AFTER UPDATE OF content ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
        INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
    END""",
    "INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')",
]


def default_path() -> Path:
    return data_dir() / "history.db"


class HistoryError(SparkchatError):
    """The history database cannot be opened (unwritable dir, corrupt file, newer schema)."""


@dataclass
class Conversation:
    id: int
    title: str
    created: float
    updated: float
    model: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    stats: dict[str, Any] | None
    status: str
    created: float


@dataclass
class SearchHit:
    conversation: Conversation
    snippet: str  # a short piece of the matching text ('' when only the title matched)


class History:
    """A handle on the history database. Thread-safe: one connection guarded by a lock."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, clock: Callable[[], float] = time.time):
        self.path = Path(path) if path is not None else default_path()
        self._clock = clock
        self._lock = threading.RLock()
        # host:pid:instance, so a later open can tell a dead writer's 'streaming' rows from a live one's.
        self._writer = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.fts = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                       check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._db.execute("PRAGMA foreign_keys = ON")
            self._migrate()
            self._mark_interrupted()
        except (OSError, sqlite3.Error) as exc:
            raise HistoryError(f"cannot open the chat history {self.path}: {exc}") from None

    # -- setup ---------------------------------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken with BEGIN IMMEDIATE so writers queue on the busy timeout."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _migrate(self) -> None:
        with self._write() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise HistoryError(f"{self.path} has history schema v{version}; this sparkchat knows "
                                   f"v{SCHEMA_VERSION} (a newer sparkchat wrote it)")
            for statement in _SCHEMA:
                db.execute(statement)
            has_fts = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'messages_fts'").fetchone() is not None
            if not has_fts:
                try:
                    db.execute("SAVEPOINT fts")
                    for statement in _FTS_SCHEMA:
                        db.execute(statement)
                    db.execute("RELEASE fts")
                    has_fts = True
                except sqlite3.OperationalError:  # SQLite built without FTS5: search falls back to LIKE
                    db.execute("ROLLBACK TO fts")
                    db.execute("RELEASE fts")
            self.fts = has_fts
            if version < SCHEMA_VERSION:
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _mark_interrupted(self) -> None:
        """'streaming' rows whose writer process is gone become 'interrupted'; their text is kept."""
        with self._write() as db:
            rows = db.execute("SELECT id, writer FROM messages WHERE status = 'streaming'").fetchall()
            dead = [row["id"] for row in rows if not _writer_alive(row["writer"])]
            db.executemany("UPDATE messages SET status = 'interrupted' WHERE id = ?", [(i,) for i in dead])

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- conversations -------------------------------------------------------------------------------

    def create(self, title: str = "New chat", *, model: str | None = None,
               settings: dict[str, Any] | None = None) -> Conversation:
        now = self._clock()
        with self._write() as db:
            cur = db.execute(
                "INSERT INTO conversations (title, created, updated, model, settings) VALUES (?, ?, ?, ?, ?)",
                (title, now, now, model, json.dumps(settings or {})),
            )
            conversation_id = cur.lastrowid
        assert conversation_id is not None
        return Conversation(conversation_id, title, now, now, model, dict(settings or {}))

    def list(self, limit: int | None = None) -> list[Conversation]:
        """Conversations, most recently updated first."""
        sql = "SELECT * FROM conversations ORDER BY updated DESC, id DESC"
        params: tuple[Any, ...] = ()
        if limit is not None:
            sql += " LIMIT ?"
            params = (limit,)
        with self._lock:
            return [_conversation(row) for row in self._db.execute(sql, params)]

    def get(self, conversation_id: int) -> Conversation | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        return _conversation(row) if row else None

    def rename(self, conversation_id: int, title: str) -> None:
        with self._write() as db:
            db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def update_settings(self, conversation_id: int, settings: dict[str, Any]) -> None:
        with self._write() as db:
            db.execute("UPDATE conversations SET settings = ? WHERE id = ?", (json.dumps(settings), conversation_id))

    def delete(self, conversation_id: int) -> None:
        with self._write() as db:
            db.execute("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))
            db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # -- messages ------------------------------------------------------------------------------------

    def messages(self, conversation_id: int) -> list[Message]:
        """The conversation's messages, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id",
                                    (conversation_id,)).fetchall()
        return [_message(row) for row in rows]

    def append(self, conversation_id: int, role: str, content: str, *, stats: dict[str, Any] | None = None,
               status: str = "complete") -> Message:
        _check(role=role, status=status)
        now = self._clock()
        with self._write() as db:
            cur = db.execute(
                "INSERT INTO messages (conversation_id, role, content, stats, status, created, writer)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, _dumps(stats), status, now, self._writer),
            )
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
            message_id = cur.lastrowid
        assert message_id is not None
        return Message(message_id, conversation_id, role, content, stats, status, now)

    def update_message(self, message_id: int, content: str | None = None, *, stats: dict[str, Any] | None = None,
                       status: str | None = None) -> None:
        """Set a message's content / stats / status; used while an answer streams and when it ends."""
        if status is not None:
            _check(status=status)
        sets, params = ["writer = ?"], [self._writer]
        if content is not None:
            sets.append("content = ?")
            params.append(content)
        if stats is not None:
            sets.append("stats = ?")
            params.append(_dumps(stats))
        if status is not None:
            sets.append("status = ?")
            params.append(status)
        with self._write() as db:
            db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*params, message_id))
            db.execute("UPDATE conversations SET updated = ? WHERE id = "
                       "(SELECT conversation_id FROM messages WHERE id = ?)", (self._clock(), message_id))

    def delete_messages_from(self, message_id: int) -> None:
        """Delete a message and every later one of its conversation (regenerate, edit and resend)."""
        with self._write() as db:
            row = db.execute("SELECT conversation_id FROM messages WHERE id = ?", (message_id,)).fetchone()
            if row is not None:
                db.execute("DELETE FROM messages WHERE conversation_id = ? AND id >= ?",
                           (row["conversation_id"], message_id))

    # -- search and export ---------------------------------------------------------------------------

    def search(self, query: str, limit: int = 50) -> list[SearchHit]:
        """Conversations whose title or messages match every word of `query`, most recent first."""
        words = query.split()
        if not words:
            return [SearchHit(c, "") for c in self.list(limit)]
        hits: dict[int, SearchHit] = {}
        with self._lock:
            title_sql = " AND ".join("title LIKE ? ESCAPE '\\'" for _ in words)
            for row in self._db.execute(f"SELECT * FROM conversations WHERE {title_sql}",
                                        [f"%{_like_escape(w)}%" for w in words]):
                hits[row["id"]] = SearchHit(_conversation(row), "")
            for conversation_id, snippet in self._search_messages(words):
                if conversation_id not in hits:
                    conv = self.get(conversation_id)
                    if conv is not None:
                        hits[conversation_id] = SearchHit(conv, snippet)
                elif not hits[conversation_id].snippet:
                    hits[conversation_id].snippet = snippet
        ordered = sorted(hits.values(), key=lambda h: (h.conversation.updated, h.conversation.id), reverse=True)
        return ordered[:limit]

    def _search_messages(self, words: list[str]) -> list[tuple[int, str]]:
        if self.fts:
            # Each word quoted (no FTS syntax from the user), the last one as a prefix for search-as-you-type.
            terms = ['"' + w.replace('"', '""') + '"' for w in words]
            terms[-1] += "*"
            try:
                rows = self._db.execute(
                    "SELECT m.conversation_id AS cid, snippet(messages_fts, 0, '', '', '…', 10) AS snip"
                    " FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid"
                    " WHERE messages_fts MATCH ? ORDER BY m.id DESC",
                    (" ".join(terms),),
                ).fetchall()
                return [(row["cid"], row["snip"]) for row in rows]
            except sqlite3.OperationalError:
                pass
        like = " AND ".join("content LIKE ? ESCAPE '\\'" for _ in words)
        rows = self._db.execute(
            f"SELECT conversation_id AS cid, content FROM messages WHERE {like} ORDER BY id DESC",
            [f"%{_like_escape(w)}%" for w in words],
        ).fetchall()
        return [(row["cid"], _snippet(row["content"], words[0])) for row in rows]

    def export_markdown(self, conversation_id: int) -> str:
        """The conversation as a Markdown document: title, date, model, then each message."""
        conv = self.get(conversation_id)
        if conv is None:
            raise KeyError(f"no conversation {conversation_id}")
        lines = [f"# {conv.title}", ""]
        when = datetime.fromtimestamp(conv.created).strftime("%Y-%m-%d %H:%M")
        lines.append(f"*{when}" + (f" · {conv.model}" if conv.model else "") + "*")
        system = conv.settings.get("system_prompt")
        if system:
            lines += ["", "## System", "", system]
        for msg in self.messages(conversation_id):
            heading = {"user": "You", "assistant": "Assistant", "system": "System"}.get(msg.role, msg.role)
            lines += ["", f"## {heading}", "", msg.content.strip()]
            if msg.status == "interrupted":
                lines += ["", "*(interrupted)*"]
            if msg.stats and msg.stats.get("decode_tok_s"):
                lines += ["", f"*{msg.stats.get('generated_tokens', 0)} tokens · "
                              f"{msg.stats['decode_tok_s']:.1f} tok/s*"]
        return "\n".join(lines).rstrip() + "\n"


# -- helpers -----------------------------------------------------------------------------------------


def _writer_alive(writer: str | None) -> bool:
    if not writer:
        return False
    try:
        host, pid_text, _ = writer.split(":", 2)
        pid = int(pid_text)
    except ValueError:
        return False
    if host != socket.gethostname() or pid == os.getpid():
        # Another host cannot be checked; a writer in this very process is an earlier, closed handle.
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check(*, role: str | None = None, status: str | None = None) -> None:
    if role is not None and role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    if status is not None and status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, not {status!r}")


def _dumps(stats: dict[str, Any] | None) -> str | None:
    return None if stats is None else json.dumps(stats)


def _like_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _snippet(content: str, word: str, width: int = 60) -> str:
    at = content.lower().find(word.lower())
    start = max(0, at - width // 2)
    text = content[start:start + width].replace("\n", " ")
    return ("…" if start else "") + text + ("…" if start + width < len(content) else "")


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(row["id"], row["title"], row["created"], row["updated"], row["model"],
                        json.loads(row["settings"] or "{}"))


def _message(row: sqlite3.Row) -> Message:
    return Message(row["id"], row["conversation_id"], row["role"], row["content"],
                   json.loads(row["stats"]) if row["stats"] else None, row["status"], row["created"])
