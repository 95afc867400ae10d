"""ModelBook (control/je/model_book.py): one model or many, which TEs serve a
request's model, and the demand the JE reports to the autoscaler."""

from __future__ import annotations

import pytest

from deepserve.control.je.model_book import DEMAND_INTERVAL_S, ModelBook
from deepserve.errors import InvalidRequestError


def test_one_model_serves_every_request_and_every_te():
    book = ModelBook("/models/tiny")
    assert book.default == "tiny" and not book.is_multi
    assert book.name_of(None) == book.name_of("anything") == "tiny"
    assert book.te_model("tiny") is None  # the router takes every TE, whatever its name


def test_many_models_route_apart_and_refuse_an_unknown_name():
    book = ModelBook({"a": "/a", "b": "/b"}, scalable=["b"])
    assert book.name_of(None) == "a" and book.name_of("b") == "b"
    with pytest.raises(InvalidRequestError) as info:
        book.name_of("c")
    assert info.value.param == "model"
    assert book.te_model("a") == "a"  # the router takes only TEs whose TEInfo.model is a
    assert book.waits_for_scaling("b") and not book.waits_for_scaling("a")


def test_prompts_use_each_models_own_tokenizer(model_dirs):
    first, other = list(model_dirs.values())[:2]
    book = ModelBook({"tiny": str(first), "other": str(other)})
    assert book.prompts("tiny") is book.prompts("tiny")  # created once
    assert book.prompts("tiny").tokenizer is not book.prompts("other").tokenizer


def test_demand_is_sent_on_change_and_repeated_while_requests_wait():
    now = [0.0]
    book = ModelBook({"a": "/a", "b": "/b"}, clock=lambda: now[0])
    assert book.demand([]) is None
    book.note_arrival("a")
    book.note_arrival("a")
    msg = book.demand(["b"])
    assert msg.arrivals == {"a": 2} and msg.parked == {"b": 1}
    assert book.demand(["b"]) is None  # nothing new, and reported just now
    now[0] += DEMAND_INTERVAL_S
    assert book.demand(["b"]).parked == {"b": 1}  # still waiting: said again
    assert book.demand([]).parked == {"b": 0}  # no longer waiting: said once
    assert book.demand([]) is None


def test_gateway_latencies_reach_the_demand_bounded_and_only_for_served_models():
    book = ModelBook({"a": "/a", "b": "/b"})
    book.add_latencies({"a": [(10.0, 2.0)] * 1500, "zz": [(1.0, None)]})
    msg = book.demand([])
    assert list(msg.latencies) == ["a"] and len(msg.latencies["a"]) == 1000
    assert book.demand([]) is None  # sent once
