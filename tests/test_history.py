import json
import multiprocessing as mp
import os
import sqlite3
import subprocess
import sys
import threading

import pytest

from sparkchat import history as history_mod
from sparkchat.history import History, HistoryError


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@pytest.fixture
def db(tmp_path):
    return tmp_path / "history.db"


@pytest.fixture
def h(db):
    with History(db, clock=Clock()) as history:
        yield history


def test_default_path_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKCHAT_DATA_DIR", str(tmp_path / "d"))
    assert history_mod.default_path() == tmp_path / "d" / "history.db"
    with History() as history:
        assert history.path == tmp_path / "d" / "history.db"
    assert (tmp_path / "d" / "history.db").exists()


def test_default_path_without_env_uses_platform_dir(monkeypatch):
    monkeypatch.delenv("SPARKCHAT_DATA_DIR", raising=False)
    from platformdirs import user_data_dir

    assert history_mod.default_path() == history_mod.Path(user_data_dir("sparkchat", appauthor=False)) / "history.db"


def test_schema_version_and_wal(h, db):
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == history_mod.SCHEMA_VERSION
    assert raw.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
    raw.close()


def test_newer_schema_is_refused(db):
    History(db).close()
    raw = sqlite3.connect(db)
    raw.execute(f"PRAGMA user_version = {history_mod.SCHEMA_VERSION + 1}")
    raw.close()
    with pytest.raises(HistoryError, match="schema v2; this sparkchat knows v1"):
        History(db)


def test_unusable_file_is_one_readable_error(tmp_path):
    bad = tmp_path / "history.db"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(HistoryError, match="cannot open the chat history"):
        History(bad)
    (tmp_path / "file").write_text("x")
    with pytest.raises(HistoryError):
        History(tmp_path / "file" / "history.db")  # its folder is a file


def test_create_get_list_newest_first(h):
    a = h.create("first", model="Ling", settings={"temperature": 0.5})
    b = h.create("second")
    assert h.get(a.id) == a
    assert h.get(a.id).settings == {"temperature": 0.5}
    assert h.get(999) is None
    assert [c.title for c in h.list()] == ["second", "first"]
    h.append(a.id, "user", "bump")  # activity moves a conversation to the top
    assert [c.id for c in h.list()] == [a.id, b.id]
    assert [c.id for c in h.list(limit=1)] == [a.id]


def test_append_and_messages_in_order(h):
    c = h.create("chat")
    u = h.append(c.id, "user", "hi")
    a = h.append(c.id, "assistant", "hello", stats={"decode_tok_s": 200.0})
    msgs = h.messages(c.id)
    assert [(m.id, m.role, m.content, m.status) for m in msgs] == [
        (u.id, "user", "hi", "complete"), (a.id, "assistant", "hello", "complete")]
    assert msgs[1].stats == {"decode_tok_s": 200.0}
    assert msgs[0].stats is None
    with pytest.raises(ValueError):
        h.append(c.id, "robot", "x")
    with pytest.raises(ValueError):
        h.append(c.id, "user", "x", status="weird")


def test_update_streaming_message(h):
    c = h.create("chat")
    m = h.append(c.id, "assistant", "", status="streaming")
    h.update_message(m.id, "partial")
    assert h.messages(c.id)[0].content == "partial"
    assert h.messages(c.id)[0].status == "streaming"
    h.update_message(m.id, "partial and done", stats={"generated_tokens": 4}, status="complete")
    got = h.messages(c.id)[0]
    assert (got.content, got.status, got.stats) == ("partial and done", "complete", {"generated_tokens": 4})
    with pytest.raises(ValueError):
        h.update_message(m.id, status="nope")


def test_streaming_rows_become_interrupted_at_next_open(db):
    h1 = History(db)
    c = h1.create("chat")
    h1.append(c.id, "user", "tell me a story")
    m = h1.append(c.id, "assistant", "", status="streaming")
    h1.update_message(m.id, "Once upon a")
    h1.close()  # the process "crashed" before finishing the answer
    with History(db) as h2:
        got = h2.messages(c.id)[1]
    assert got.status == "interrupted"
    assert got.content == "Once upon a"


def _hold_streaming_row(path: str, ready, done) -> None:
    h = History(path)
    c = h.create("live")
    h.append(c.id, "assistant", "still going", status="streaming")
    ready.set()
    done.wait(30)
    h.close()


def test_live_writer_rows_are_not_marked_interrupted(db):
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold_streaming_row, args=(str(db), ready, done))
    proc.start()
    try:
        assert ready.wait(30)
        with History(db) as other:  # a second app opening while the first is still answering
            (conv,) = other.list()
            assert other.messages(conv.id)[0].status == "streaming"
    finally:
        done.set()
        proc.join(30)
    # once that process is gone, the row is an interrupted answer
    with History(db) as later:
        assert later.messages(later.list()[0].id)[0].status == "interrupted"


def test_rename_and_update_settings(h):
    c = h.create("old")
    h.rename(c.id, "new title")
    h.update_settings(c.id, {"thinking": False})
    got = h.get(c.id)
    assert got.title == "new title"
    assert got.settings == {"thinking": False}


def test_delete_removes_conversation_and_messages(h, db):
    c = h.create("doomed")
    h.append(c.id, "user", "findme-unique")
    keep = h.create("kept")
    h.delete(c.id)
    assert h.get(c.id) is None
    assert h.messages(c.id) == []
    assert [x.id for x in h.list()] == [keep.id]
    assert h.search("findme") == []


def test_delete_messages_from(h):
    c = h.create("chat")
    ids = [h.append(c.id, r, t).id for r, t in [("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")]]
    h.delete_messages_from(ids[2])
    assert [m.content for m in h.messages(c.id)] == ["a", "b"]


def test_search_titles_and_messages(h):
    a = h.create("Rust lifetimes")
    h.append(a.id, "user", "explain borrow checker")
    b = h.create("cooking")
    h.append(b.id, "user", "a recipe for pasta carbonara")
    h.append(b.id, "assistant", "Boil the spaghetti, then whisk eggs")
    assert [hit.conversation.id for hit in h.search("rust")] == [a.id]
    hits = h.search("spaghetti")
    assert [hit.conversation.id for hit in hits] == [b.id]
    assert "spaghetti" in hits[0].snippet
    assert [hit.conversation.id for hit in h.search("spag")] == [b.id]  # prefix while typing
    assert [hit.conversation.id for hit in h.search("pasta carbonara")] == [b.id]
    assert h.search("pasta rust") == []  # every word must match
    assert {hit.conversation.id for hit in h.search("")} == {a.id, b.id}
    # user text is never FTS syntax
    for q in ['"', "AND", "a OR", "(", "NEAR(", "*", "50%", "x_y", "col:val"]:
        h.search(q)


def test_search_like_fallback(h):
    c = h.create("plain")
    h.append(c.id, "user", "the quick brown fox")
    h.fts = False  # as on an SQLite built without FTS5
    assert [hit.conversation.id for hit in h.search("brown")] == [c.id]
    assert [hit.conversation.id for hit in h.search("50%")] == []
    assert "brown" in h.search("brown")[0].snippet


def test_fts_tracks_updates(h):
    c = h.create("chat")
    m = h.append(c.id, "assistant", "", status="streaming")
    h.update_message(m.id, "zebra")
    assert [hit.conversation.id for hit in h.search("zebra")] == [c.id]
    h.update_message(m.id, "giraffe")
    assert h.search("zebra") == []
    assert [hit.conversation.id for hit in h.search("giraffe")] == [c.id]


def test_export_markdown(h):
    c = h.create("Squares", model="Ling-3.0-flash", settings={"system_prompt": "Be brief."})
    h.append(c.id, "user", "square a list")
    h.append(c.id, "assistant", "```python\n[x * x for x in xs]\n```",
             stats={"generated_tokens": 12, "decode_tok_s": 210.5})
    h.append(c.id, "assistant", "half an ans", status="interrupted")
    md = h.export_markdown(c.id)
    assert md.startswith("# Squares\n")
    assert "Ling-3.0-flash" in md
    assert "## System\n\nBe brief." in md
    assert md.index("## You\n\nsquare a list") < md.index("## Assistant\n\n```python\n[x * x for x in xs]\n```")
    assert "12 tokens · 210.5 tok/s" in md
    assert "half an ans\n\n*(interrupted)*" in md
    with pytest.raises(KeyError):
        h.export_markdown(12345)


def test_thread_safe_single_handle(h):
    c = h.create("threads")
    errors = []

    def work(n):
        try:
            for i in range(50):
                m = h.append(c.id, "assistant", "", status="streaming")
                h.update_message(m.id, f"{n}-{i}", status="complete")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(h.messages(c.id)) == 200


def test_two_handles_write_concurrently(db):
    a, b = History(db), History(db)
    ca, cb = a.create("a"), b.create("b")
    errors = []

    def work(h, cid):
        try:
            for i in range(100):
                m = h.append(cid, "user", f"msg {i}")
                h.update_message(m.id, f"msg {i} edited")
                h.search("msg")
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(a, ca.id)), threading.Thread(target=work, args=(b, cb.id))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(a.messages(cb.id)) == 100 and len(b.messages(ca.id)) == 100
    a.close()
    b.close()


WRITER = """
import sys
from sparkchat.history import History
h = History(sys.argv[1])
c = h.create("proc " + sys.argv[2])
for i in range(int(sys.argv[3])):
    m = h.append(c.id, "assistant", "", status="streaming")
    h.update_message(m.id, f"token {i} " * 20, stats={"i": i}, status="complete")
    h.list()
h.close()
"""


def test_two_processes_write_concurrently(db):
    History(db).close()
    n = 150
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(db), str(k), str(n)],
                              stderr=subprocess.PIPE, text=True) for k in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    raw.close()
    with History(db) as h:
        convs = h.list()
        assert sorted(c.title for c in convs) == ["proc 0", "proc 1", "proc 2"]
        for c in convs:
            msgs = h.messages(c.id)
            assert len(msgs) == n
            assert all(m.status == "complete" for m in msgs)
            assert [json.loads(json.dumps(m.stats))["i"] for m in msgs] == list(range(n))
        if h.fts:
            raw = sqlite3.connect(db)
            raw.execute("INSERT INTO messages_fts(messages_fts) VALUES ('integrity-check')")
            raw.close()
    assert os.path.exists(db)
