"""PD-aware TE-type choice: heatmap, decode-length predictor, PDPolicy (pure Python)."""

import json
import random
from pathlib import Path

import pytest

from deepserve.config.node import PDOptions
from deepserve.control.je.routing.decode_predictor import DecodeLengthPredictor, bucket_of, featurize
from deepserve.control.je.routing.pd_heatmap import Heatmap, PDConfigError
from deepserve.control.je.routing.pd_policy import PDPolicy

P_EDGES = [0, 512, 2048, 8192]
R_EDGES = [0, 0.125, 1, 8]


def heatmap(disagg_long_short: bool = True) -> Heatmap:
    """Rows: prompts <512, 512-2048, >=2048; cols: d/p <1/8, 1/8-1, >=1."""
    values = [[-0.05, -0.10, -0.20],
              [0.30, None, -0.10],
              [0.80, 0.25, -0.05]]
    if not disagg_long_short:
        values = [[None if v is None else -v for v in row] for row in values]
    return Heatmap(P_EDGES, R_EDGES, values, model="tiny", source="test", rates=[1.0, 2.0],
                   created="2025-01-01T00:00:00Z")


def test_heatmap_round_trip(tmp_path):
    hm = heatmap()
    hm.save(tmp_path / "h.json")
    back = Heatmap.load(tmp_path / "h.json")
    assert back == hm
    assert json.loads((tmp_path / "h.json").read_text())["values"][1][1] is None


def test_heatmap_lookup_and_clamping():
    hm = heatmap()
    assert hm.lookup(100, 400) == -0.20          # ratio 4 -> last col
    assert hm.lookup(4096, 100) == 0.80          # ratio 0.024 -> first col
    assert hm.lookup(2048, 2048) == -0.05        # edges belong to the upper bin
    assert hm.lookup(1000, 500) is None          # unmeasured cell
    assert hm.lookup(10**6, 10) == 0.80          # past the last prompt edge: last row
    assert hm.lookup(1000, 10**6) == -0.10       # past the last ratio edge: last col
    assert hm.lookup(0, 5) == -0.20              # empty prompt: ratio 5 / 1, first row
    below = Heatmap([100, 200, 300], [0.5, 1, 2], [[1.0, 2.0], [3.0, 4.0]])
    assert below.lookup(1, 0) == 1.0            # below the first edges: first row / col


def test_heatmap_grid_text():
    text = heatmap().to_grid_text()
    for cell in ("+0.80", "+0.25", "-0.05", "-0.20", "+0.30"):
        assert cell in text
    lines = text.splitlines()
    assert len(lines) == 2 + 3
    assert lines[2].startswith("0-512") and lines[3].split()[2] == "."


def test_heatmap_combine_sums_measured_cells():
    a, b = heatmap(), heatmap()
    b.values[1][1], b.rates = 0.5, [4.0]
    c = Heatmap.combine([a, b])
    assert c.values[0][0] == pytest.approx(-0.10) and c.values[1][1] == 0.5
    assert c.rates == [1.0, 2.0, 4.0]


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d.update(values=[[1.0]]), "rows"),
    (lambda d: d.update(prompt_len_edges=[0, 0, 5, 6]), "strictly increasing"),
    (lambda d: d.update(colour="red"), "unknown keys"),
    (lambda d: d["values"][0].__setitem__(0, "big"), "finite number"),
    (lambda d: d.update(format="other/2"), "format"),
])
def test_heatmap_bad_files(tmp_path, mutate, words):
    data = heatmap().to_json()
    mutate(data)
    path = tmp_path / "h.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PDConfigError, match=words) as e:
        Heatmap.load(path)
    assert "h.json" in str(e.value)


def test_missing_and_garbled_files(tmp_path):
    with pytest.raises(PDConfigError, match="nope.json.*does not exist"):
        Heatmap.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PDConfigError, match="bad.json"):
        DecodeLengthPredictor.load(tmp_path / "bad.json")
    (tmp_path / "p.json").write_text(json.dumps({"format": "x"}))
    with pytest.raises(ValueError, match="p.json"):
        DecodeLengthPredictor.load(tmp_path / "p.json")


# -- predictor --------------------------------------------------------------------------
def synthetic(n: int, seed: int) -> list[tuple[list[int], int]]:
    """Long prompts of 'code' ids -> short outputs (bucket 0); short prompts of
    'chat' ids -> long outputs (bucket 4); a few noisy labels."""
    rng, pairs = random.Random(seed), []
    for _ in range(n):
        if rng.random() < 0.5:
            ids, out = [rng.randint(1000, 1999) for _ in range(rng.randint(800, 3000))], \
                rng.randint(10, 120)
        else:
            ids, out = [rng.randint(2000, 2999) for _ in range(rng.randint(10, 100))], \
                rng.randint(512, 639)
        if rng.random() < 0.05:
            out = rng.randint(0, 1023)
        pairs.append((ids, out))
    return pairs


@pytest.fixture(scope="module")
def trained():
    train, held = synthetic(400, seed=1), synthetic(200, seed=2)
    return DecodeLengthPredictor.train(train, num_buckets=8, epochs=40, seed=0), held


def test_predictor_learns_separable_task(trained):
    pred, held = trained
    counts = [0] * 8
    for _, n in held:
        counts[bucket_of(n, 8)] += 1
    baseline = max(counts) / len(held)
    acc = pred.accuracy(held)
    assert acc > baseline + 0.3 and acc > 0.85
    assert pred.predict_bucket(list(range(1000, 3000))) == 0
    assert pred.predict_length(list(range(1000, 3000))) == 64
    assert pred.predict_bucket(list(range(2000, 2040))) >= 3


def test_predictor_save_load_identical(trained, tmp_path):
    pred, held = trained
    pred.save(tmp_path / "p.json")
    back = DecodeLengthPredictor.load(tmp_path / "p.json")
    assert back.weights == pred.weights and back.num_buckets == 8
    for ids, _ in held[:50]:
        assert back.logits(ids) == pred.logits(ids)
        assert back.predict_bucket(ids) == pred.predict_bucket(ids)


def test_buckets_and_features():
    assert [bucket_of(n, 8) for n in (0, 127, 128, 1023, 1024, 99999)] == [0, 0, 1, 7, 7, 7]
    f = featurize(list(range(100)), num_hash=256, window=64)
    assert f[0] == 1.0 and sum(v for i, v in f.items() if i >= 19) == pytest.approx(1.0)
    assert featurize([]) == {0: 1.0, 1: 0.0, 2: 0.0, 3: 1.0}


@pytest.mark.parametrize("window", [64, 7, 0])
def test_fast_logits_equal_the_plain_sum(window):
    """logits() (memoized slots, itemgetter, sum of map) gives the plain
    formula's floats exactly, on the shipped predictor and on random weights."""
    rng = random.Random(window)
    shipped = DecodeLengthPredictor.load(Path(__file__).parents[2] / "conf/decode_predictor.json")
    dim = 3 + 16 + 32
    rand = DecodeLengthPredictor([[rng.uniform(-3, 3) for _ in range(dim)] for _ in range(5)],
                                 num_hash=32, window=window)
    for pred in (shipped, rand):
        for _ in range(60):
            n = rng.choice([0, 1, 5, 63, 64, 65, 300, 5000])
            ids = [rng.randrange(rng.choice([50, 152_064])) for _ in range(n)]
            feats = featurize(ids, pred.num_hash, pred.window)
            plain = [sum(row[i] * v for i, v in feats.items()) for row in pred.weights]
            assert pred.logits(ids) == plain
            assert featurize(ids, pred.num_hash, pred.window, {}) == feats
            assert list(featurize(ids, pred.num_hash, pred.window, {})) == list(feats)


# -- policy -----------------------------------------------------------------------------
LONG_PROMPT_SHORT_OUT = list(range(1000, 3000))   # predicted bucket 0: d = 64, p = 2000
SHORT_PROMPT_LONG_OUT = list(range(2000, 2040))   # predicted bucket >= 3, p = 40


@pytest.mark.parametrize("mode", ["threshold", "heatmap"])
def test_policy_routes_by_shape(trained, mode):
    pol = PDPolicy(mode, heatmap(), trained[0])
    assert pol.choose(LONG_PROMPT_SHORT_OUT) == "disaggregated"
    assert pol.last_decision.rule == mode and pol.last_decision.decode_len == 64
    assert pol.choose(SHORT_PROMPT_LONG_OUT) == "colocated"
    assert pol.last_decision.decode_len >= 3 * 128


def test_opposite_heatmap_flips(trained):
    pol = PDPolicy("heatmap", heatmap(disagg_long_short=False), trained[0])
    d = pol.decide(LONG_PROMPT_SHORT_OUT)
    assert d.te_type == "colocated" and d.heatmap_value == -0.30 and "heatmap -0.30" in d.reason
    assert pol.choose(SHORT_PROMPT_LONG_OUT) == "disaggregated"


def test_margin_and_unmeasured_cell(trained):
    pol = PDPolicy("heatmap", heatmap(), trained[0], margin=0.5)
    assert pol.choose(LONG_PROMPT_SHORT_OUT) == "colocated"          # +0.30 <= 0.5
    hm = heatmap()
    hm.values[1][0] = None
    d = PDPolicy("heatmap", hm, trained[0]).decide(LONG_PROMPT_SHORT_OUT)
    assert d.te_type == "disaggregated" and d.rule == "threshold" and "unmeasured" in d.reason


def test_length_only_fixed_modes_and_availability():
    pol = PDPolicy("threshold", min_prompt_len=1024)
    assert pol.choose([1] * 1024) == "disaggregated" and pol.last_decision.rule == "length"
    assert pol.choose([1] * 1023) == "colocated"
    assert PDPolicy().choose([1] * 5000) == "colocated"
    assert PDPolicy("disaggregated").choose([1]) == "disaggregated"
    d = pol.decide([1] * 2000, te_types={"colocated"})
    assert d.te_type == "colocated" and d.rule == "fallback"
    assert pol.choose([1] * 2000, te_types={"prefill", "decode", "colocated"}) == "disaggregated"
    assert pol.choose([1] * 10, te_types={"prefill", "decode"}) == "disaggregated"


def test_bad_config(tmp_path, trained):
    with pytest.raises(PDConfigError, match="mode"):
        PDPolicy("random")
    with pytest.raises(ValueError, match="mode"):
        PDPolicy.from_files("fastest")
    with pytest.raises(PDConfigError, match="needs a heatmap"):
        PDPolicy("heatmap", heatmap(), None)
    with pytest.raises(PDConfigError, match="missing.json"):
        PDPolicy.from_files("threshold", predictor_path=tmp_path / "missing.json")
    with pytest.raises(PDConfigError, match="unknown PD policy option"):
        PDPolicy.from_files("threshold", min_prompt=5)
    heatmap().save(tmp_path / "h.json")
    trained[0].save(tmp_path / "p.json")
    pol = PDPolicy.from_files("heatmap", tmp_path / "h.json", tmp_path / "p.json", margin=0.1)
    assert pol.margin == 0.1 and pol.choose(LONG_PROMPT_SHORT_OUT) == "disaggregated"


def test_shipped_conf_files_load():
    """conf/pd_heatmap.json (tools/profile_pd.py) and conf/decode_predictor.json
    (tools/train_predictor.py) load. The map was profiled with equal CPU per
    layout (2 colocated TEs against 1P1D), and at the configured default margin
    only cells above the noise go disaggregated: most of the map stays colocated."""
    conf = Path(__file__).resolve().parents[2] / "conf"
    margin = PDOptions().margin
    pol = PDPolicy.from_files("heatmap", conf / "pd_heatmap.json", conf / "decode_predictor.json",
                              margin=margin)
    assert pol.heatmap.source == "tools/profile_pd.py"
    assert "2 colocated TE(s)" in pol.heatmap.notes and len(pol.heatmap.rates) == 3
    assert pol.predictor.num_buckets == 8
    cells = [v for row in pol.heatmap.values for v in row if v is not None]
    noisy = [v for v in cells if 0 < v <= margin]
    assert noisy and sum(v > margin for v in cells) < len(cells) / 2
    p, d = 1024, 32  # a cell the 1-TE profile sent disaggregated; +0.15 now, within noise
    assert 0 < pol.heatmap.lookup(p, d) <= margin
    assert pol.choose([5] * p, max_tokens=d) == "colocated"


@pytest.mark.parametrize("mode", ["threshold", "heatmap"])
def test_a_request_s_own_bound_caps_the_predicted_decode_length(trained, mode):
    """A short prompt predicted to decode long is still a short decode when its
    max_tokens says so: min(predicted, max_tokens) picks the cell."""
    pol = PDPolicy(mode, heatmap(), trained[0], min_prompt_len=0)
    assert pol.choose(SHORT_PROMPT_LONG_OUT) == "colocated"
    assert pol.last_decision.decode_len >= 3 * 128
    before = pol.last_decision.heatmap_value
    te_type = pol.choose(SHORT_PROMPT_LONG_OUT, max_tokens=4)
    assert pol.last_decision.decode_len == 4
    if mode == "threshold":  # p >= 0 and d <= 128: now a short decode
        assert te_type == "disaggregated"
    else:  # p = 40, d/p = 0.1: the first column (-0.05), no longer d/p >= 1 (-0.20)
        assert (before, pol.last_decision.heatmap_value) == (-0.20, -0.05)
