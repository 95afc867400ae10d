"""tools/token_trip.py: one token's hops from made-up spans, joined as a real run's."""

from __future__ import annotations

import sys

import pytest

from deepserve.ipc.timeline import Timeline, read_spans, token_key
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import token_trip  # noqa: E402

MS = 1e-3


def _write(folder, component: str, spans: list[tuple]) -> None:
    tl = Timeline(component, str(folder))
    for span in spans:
        tl.add(*span)
    tl.close()


def test_a_tokens_hops_add_up_to_its_trip(tmp_path):
    """Step 7 carries token 2 of request r-0; the text of token 3 (step 8) is
    held back (no event), so the client's 2nd event is token 4's."""
    worker, master, tok, gw = [], [], [], []
    for step, num, chunks in ((7, 2, 1), (8, 3, 0), (9, 4, 1)):
        t = step * 100 * MS
        worker += [("forward", step, t, t + 10 * MS, 1), ("sample", step, t + 10 * MS, t + 11 * MS),
                   ("step_done", step, t + 11 * MS, t + 11.5 * MS)]
        master += [("collect", step, t + 12 * MS, t + 12.5 * MS, 1)]
        tok += [("detokenize", step, t + 13 * MS, t + 13.2 * MS, 1),
                ("reply_item", step, t + 13.2 * MS, t + 13.4 * MS, 1, token_key("r-0", num))]
        gw += [("sse", -1, t + 15 * MS, t + 16 * MS, chunks, token_key("r-0", num))]
    for component, spans in (("te1-worker0", worker), ("te1-master", master),
                             ("te1-tokenizer", tok), ("gateway", gw)):
        _write(tmp_path, component, spans)
    arrivals = {("r-0", 1): 0.7165, ("r-0", 2): 0.9165, ("r-0", 3): 5.0}
    hops = token_trip.trip(read_spans(tmp_path), arrivals)
    assert len(hops["client wire"]) == 2  # tokens 2 and 4: token 3 never reached the client
    expect = {"worker forward": 10, "worker sample": 1, "worker step_done": 0,
              "master wake": 1.0, "master collect": 0.5, "tokenizer wake": 0.5,
              "tokenizer detok+reply": 0.4, "gateway wake": 1.6, "gateway sse": 1.0,
              "client wire": 0.5, "total: forward end -> client": 6.5}
    for hop, ms in expect.items():
        assert hops[hop] == pytest.approx([ms * MS] * 2), hop
