"""The worker body and the stream buffer, without Textual: wake-ups, cancel, errors, saving, rates."""

import threading

import pytest
from fake_engine import FakeEngine

from sparkchat.engine.errors import ContextOverflowError
from sparkchat.engine.events import GenerationStats, ResponseEvent, SamplingParams
from sparkchat.ui.messages import StreamChunk, StreamDone
from sparkchat.ui.streaming import CANCEL_GRACE_EVENTS, Job, RateMeter, StreamBuffer, run_job


class Clock:
    def __init__(self, step: float) -> None:
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


class Recorder:
    def __init__(self) -> None:
        self.posts, self.saves = [], []

    def post(self, message) -> None:
        self.posts.append(message)

    def save(self, content, stats=None, status=None) -> None:
        self.saves.append((content, stats, status))


def job(engine, **kw) -> Job:
    return Job(1, engine, [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=100_000), True, **kw)


def test_one_wake_up_until_the_ui_drains():
    text = "".join(f"w{i} " for i in range(2000))
    engine = FakeEngine([text], chunk=2)
    rec = Recorder()
    j = job(engine)
    assert run_job(j, rec.post, rec.save) == "stop"
    # the UI never drained: the engine was not slowed and posted a single wake-up
    chunks = [m for m in rec.posts if isinstance(m, StreamChunk)]
    assert len(chunks) == 1 and chunks[0].buffer is j.buffer
    done = rec.posts[-1]
    assert isinstance(done, StreamDone) and done.finish_reason == "stop" and done.error is None
    assert done.text == text
    assert j.buffer.take()[0] == text


def test_a_draining_ui_gets_everything_once():
    text = "".join(f"w{i} " for i in range(300))
    engine = FakeEngine([text], chunk=3)
    j = job(engine)
    shown, wakes, snapshots = [], [], []

    def post(message):
        if isinstance(message, StreamChunk):
            wakes.append(message)
            got, stats = message.buffer.take()
            shown.append(got)
            snapshots.append(stats)

    run_job(j, post, lambda *a, **k: None)
    rest, _ = j.buffer.take()
    assert len(wakes) == -(-len(text) // 3)  # an idle UI is woken for each event
    assert "".join(shown) + rest == text
    tokens = [s.generated_tokens for s in snapshots]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)  # snapshots, not one shared object


def test_buffer_wakes_only_after_a_take():
    buf = StreamBuffer()
    stats = GenerationStats(generated_tokens=1)
    assert buf.push("a", stats) is True
    assert buf.push("b", stats) is False
    stats.generated_tokens = 2
    text, snap = buf.take()
    assert text == "ab" and snap.generated_tokens == 2 and snap is not stats
    assert buf.take()[0] == ""
    assert buf.push("c", stats) is True


def test_rate_meter_uses_engine_decode_time():
    meter = RateMeter(Clock(1.0))  # wall time runs much slower than the engine's own clock below
    stats = GenerationStats()
    meter.update(stats)
    assert meter.samples == []
    stats.generated_tokens, stats.decode_s = 1, 0.005
    meter.update(stats)
    stats.generated_tokens, stats.decode_s = 51, 0.255
    meter.update(stats)
    meter.update(stats)  # no new tokens: no sample
    assert meter.samples == [pytest.approx(200.0)]
    stats.generated_tokens = 61  # an engine that reports no decode time: wall clock
    meter.update(stats)
    assert meter.samples[-1] == pytest.approx(10 / 2.0)  # two clock reads since the last sample


def test_partial_answer_saved_while_streaming_and_final_status():
    engine = FakeEngine(["x" * 300], chunk=1)
    rec = Recorder()
    run_job(job(engine), rec.post, rec.save, clock=Clock(0.01), save_s=0.5)
    partial = [s for s in rec.saves if s[2] is None]
    assert len(partial) >= 4 and all(0 < len(s[0]) < 300 for s in partial)
    content, stats, status = rec.saves[-1]
    assert (content, status) == ("x" * 300, "complete")
    assert stats["finish_reason"] == "stop" and stats["generated_tokens"] == 300


def test_cancel_stops_and_marks_interrupted():
    engine = FakeEngine(["y" * 1000], chunk=1)
    j = job(engine)
    rec = Recorder()

    def post(message):
        rec.post(message)
        if isinstance(message, StreamChunk):
            message.buffer.take()
            if sum(isinstance(m, StreamChunk) for m in rec.posts) == 3:
                j.cancel.set()

    assert run_job(j, post, rec.save) == "cancelled"
    done = rec.posts[-1]
    assert done.finish_reason == "cancelled"
    assert done.text == "yyy"
    assert engine.finished == ["cancelled"]  # the engine ended the answer itself, its state whole
    assert rec.saves[-1][2] == "interrupted" and rec.saves[-1][0] == "yyy"


def test_an_engine_that_ignores_cancel_is_closed():
    closed = []

    class Deaf:
        def set_switches(self, s):
            pass

        def generate(self, messages, params, *, enable_thinking=True, cancel=None):
            try:
                for i in range(10_000):
                    yield ResponseEvent("x", [i], None, GenerationStats(generated_tokens=i + 1))
            finally:
                closed.append(True)

    j = job(Deaf())
    j.cancel.set()
    rec = Recorder()
    assert run_job(j, rec.post, rec.save) == "cancelled"
    assert closed == [True]
    assert rec.posts[-1].text == "x" * (CANCEL_GRACE_EVENTS + 1)


def test_reset_before_generate():
    engine = FakeEngine(["ok"])
    rec = Recorder()
    run_job(job(engine, reset=True), rec.post, rec.save)
    assert engine.resets == 1 and len(engine.calls) == 1
    run_job(job(engine), rec.post, rec.save)
    assert engine.resets == 1


class Failing:
    def __init__(self, exc, after: int = 0) -> None:
        self.exc, self.after = exc, after

    def set_switches(self, s):
        pass

    def reset(self):
        pass

    def generate(self, messages, params, *, enable_thinking=True, cancel=None):
        for i in range(self.after):
            yield ResponseEvent("t", [i], None, GenerationStats(generated_tokens=i + 1))
        raise self.exc


def test_engine_errors_become_a_done_message():
    rec = Recorder()
    assert run_job(job(Failing(ContextOverflowError("prompt is 9000 tokens; the context holds 8192"))),
                   rec.post, rec.save) == "error"
    assert rec.posts[-1].error == "prompt is 9000 tokens; the context holds 8192"
    rec = Recorder()
    run_job(job(Failing(RuntimeError("CUDA out of memory"), after=3)), rec.post, rec.save)
    done = rec.posts[-1]
    assert done.error == "RuntimeError: CUDA out of memory" and done.text == "ttt"
    assert rec.saves[-1][2] == "interrupted"


def test_history_failure_does_not_end_the_answer():
    def save(*a, **k):
        raise OSError("disk full")

    rec = Recorder()
    assert run_job(job(FakeEngine(["hello"])), rec.post, save) == "stop"
    assert rec.posts[-1].text == "hello" and "disk full" in rec.posts[-1].error


def test_gated_engine_blocks_until_cancel():
    engine = FakeEngine(["z" * 50], chunk=1, gate_after=10)
    j = job(engine)
    rec = Recorder()
    t = threading.Thread(target=run_job, args=(j, rec.post, rec.save))
    t.start()
    assert engine.gated.wait(5)
    assert j.buffer.take()[0] == "z" * 10  # everything before the pause is there to show
    j.cancel.set()
    t.join(5)
    assert not t.is_alive()
    assert rec.posts[-1].text == "z" * 10 and rec.posts[-1].finish_reason == "cancelled"
