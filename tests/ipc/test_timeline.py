"""The step timeline's recorder (ipc/timeline.py): off costs nothing and
writes nothing; on, every span comes back from the file it wrote."""

from __future__ import annotations

import os

from deepserve.ipc.timeline import ENV, MAX_SPANS, Timeline, read_spans, token_key


def test_off_records_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    for folder in (None, ""):
        tl = Timeline("te0/master", folder)
        tl.add("schedule", 1, 0.0, 1.0)
        assert not tl.on and tl.spans == [] and tl.close() is None
    assert list(tmp_path.iterdir()) == []


def test_on_writes_every_span_once_per_component(tmp_path):
    master = Timeline("te0/master", str(tmp_path / "t"))
    worker = Timeline("te0/worker0", str(tmp_path / "t"))
    master.add("schedule", 3, 1.0, 1.5, 8)
    worker.add("forward", 3, 1.5, 2.5, 8)
    worker.add("sample", 3, 2.5, 2.75)
    path = master.close()
    assert path.name == f"te0-master-{os.getpid()}.jsonl"
    worker.close()
    assert master.close() is None  # written once: nothing left
    spans = read_spans(tmp_path / "t")
    assert spans == {"te0-master": [("schedule", 3, 1.0, 1.5, 8, "")],
                     "te0-worker0": [("forward", 3, 1.5, 2.5, 8, ""),
                                     ("sample", 3, 2.5, 2.75, 0, "")]}


def test_spans_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr("deepserve.ipc.timeline.MAX_SPANS", 3)
    tl = Timeline("w", str(tmp_path))
    for i in range(5):
        tl.add("forward", i, i, i + 1)
    assert [s[1] for s in tl.spans] == [0, 1, 2]
    assert MAX_SPANS >= 100_000  # the real bound holds a long profile


def test_the_environment_turns_a_timeline_on_and_a_key_names_a_token(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert not Timeline("gateway").on
    monkeypatch.setenv(ENV, str(tmp_path))  # what a node's processes inherit
    tl = Timeline("gateway")
    tl.add("sse", -1, 1.0, 2.0, 1, token_key("cmpl-1-0", 3))
    assert tl.close() is not None
    assert read_spans(tmp_path) == {"gateway": [("sse", -1, 1.0, 2.0, 1, "cmpl-1-0#3")]}
