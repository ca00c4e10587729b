"""Two threads on one ds4c.Model (issue 28, item 1): a Model serializes its generations, so each thread gets
the tokens its prompt gets alone, whether it asks for a completion or a stream."""

from __future__ import annotations

import threading

import pytest

from ds4c.api import Model

PROMPTS = ("The quick brown fox", "Once upon a time")
N_NEW = 10


@pytest.fixture(scope="module")
def model(tiny_path) -> Model:
    return Model(tiny_path, max_ctx=64)


@pytest.fixture(scope="module")
def solos(model: Model) -> tuple:
    """The new ids of each prompt generated alone (a tuple of lists; tests only compare them)."""
    return tuple(model.generate(p, max_new_tokens=N_NEW, ignore_eos=True).ids for p in PROMPTS)


def _run_both(model: Model, stream: bool) -> list:
    """Both prompts at once, one thread each (started together by a barrier); the new ids of each, or the
    exception a thread raised."""
    out: list = [None, None]
    go = threading.Barrier(2)

    def work(i: int) -> None:
        go.wait()
        try:
            if stream:
                s = model.generate(PROMPTS[i], max_new_tokens=N_NEW, ignore_eos=True, stream=True)
                for _ in s:  # piece by piece, so the two threads' steps would interleave without the lock
                    pass
                out[i] = s.completion.ids
            else:
                out[i] = model.generate(PROMPTS[i], max_new_tokens=N_NEW, ignore_eos=True).ids
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            out[i] = e

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread did not finish (deadlock?)"
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["completion", "stream"])
def test_two_threads_on_one_model_get_their_solo_outputs(model, solos, stream):
    solo = list(solos)
    assert solo[0] != solo[1]
    for trial in range(4):
        got = _run_both(model, stream)
        assert got == solo, f"trial {trial}: {got} != {solo}"


def _in_thread(model: Model, prompt: str) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(model.generate(prompt, max_new_tokens=N_NEW, ignore_eos=True).ids))
    t.start()
    return t, out


@pytest.mark.parametrize("how", ["close", "drop", "exhaust"])
def test_an_unfinished_stream_holds_the_model_until_it_ends(model, solos, how):
    """Another thread's generation waits while a stream is unfinished and runs once it is closed, dropped
    (garbage-collected) or read to its end; the stream's own tokens are its solo ones."""
    solo = solos
    s = model.generate(PROMPTS[0], max_new_tokens=N_NEW, ignore_eos=True, stream=True)
    next(s)
    t, out = _in_thread(model, PROMPTS[1])
    t.join(timeout=0.5)
    assert t.is_alive() and not out, "the other thread did not wait for the unfinished stream"
    if how == "close":
        c = s.close()
        assert c.stop_reason == "stop" and c.ids == solo[0][:len(c.ids)]
    elif how == "drop":
        del s
    else:
        assert s.completion.ids == solo[0]
    t.join(timeout=120)
    assert not t.is_alive() and out == [solo[1]]


def test_the_same_thread_ends_its_own_stream_without_waiting(model, solos):
    """On the thread that holds the Model a new generation starts at once and ends that thread's unfinished
    stream (whose next read is a one-line StepError); a stream closed before its first piece ends cleanly."""
    from ds4c.errors import StepError

    solo = solos[1]
    s = model.generate(PROMPTS[0], max_new_tokens=N_NEW, ignore_eos=True, stream=True)
    next(s)
    assert model.generate(PROMPTS[1], max_new_tokens=N_NEW, ignore_eos=True).ids == solo
    with pytest.raises(StepError, match="ended by another generation"):
        next(s)
    c = model.generate(PROMPTS[0], max_new_tokens=N_NEW, stream=True).close()  # never read
    assert c.stop_reason == "stop" and c.ids == [] and c.text == ""
    t, out = _in_thread(model, PROMPTS[1])  # nothing holds the Model now
    t.join(timeout=120)
    assert out == [solo]
