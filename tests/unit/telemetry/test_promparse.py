"""The Prometheus text parser on messy real-world expositions, and round trips with our own writer."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from services.common.prom import Histogram, PromText
from services.telemetry.promparse import PromParseError, parse
from tests.unit.telemetry import samples

MESSY = r'''# A free comment, then a blank line

# HELP http_requests_total The total number of HTTP requests, with a \\ backslash and a \n newline.
# TYPE http_requests_total counter
http_requests_total{method="post",code="200"} 1027 1395066363000
http_requests_total{method="post",code="400"}    3 1395066363000
http_requests_total { method = "get" , code = "200" , } 5

# Escaping in label values:
msdos_file_access_time_seconds{path="C:\\DIR\\FILE.TXT",error="Cannot find file:\n\"FILE.TXT\""} 1.458255915e9
quoted{a="x}y, z=\"w\"", b="#not a comment"} +Inf

# Minimalistic line:
metric_without_timestamp_and_labels 12.47
# A weird metric from before the epoch:
something_weird{problem="division by zero"} -Inf -3982045
nan_gauge NaN

# TYPE http_request_duration_seconds histogram
http_request_duration_seconds_bucket{le="0.05"} 24054
http_request_duration_seconds_bucket{le="0.1"} 33444
http_request_duration_seconds_bucket{le="+Inf"} 144320
http_request_duration_seconds_sum 53423
http_request_duration_seconds_count 144320

# TYPE rpc_duration_seconds summary
rpc_duration_seconds{quantile="0.5"} 4773
rpc_duration_seconds{quantile="0.99"} 76656
rpc_duration_seconds_sum 1.7560473e+07
rpc_duration_seconds_count 2693
# TYPE exemplary counter
exemplary_total 7 # {trace_id="abc"} 1.0
'''


def test_a_messy_exposition_parses_into_families_with_their_samples() -> None:
    e = parse(MESSY)
    requests = e.families["http_requests_total"]
    assert requests.type == "counter"
    assert requests.help == "The total number of HTTP requests, with a \\ backslash and a \n newline."
    assert [(s.labels, s.value, s.timestamp_ms) for s in requests.samples] == [
        ({"method": "post", "code": "200"}, 1027.0, 1395066363000),
        ({"method": "post", "code": "400"}, 3.0, 1395066363000),
        ({"method": "get", "code": "200"}, 5.0, None),
    ]
    (msdos,) = e.samples("msdos_file_access_time_seconds")
    assert msdos.labels == {"path": "C:\\DIR\\FILE.TXT", "error": 'Cannot find file:\n"FILE.TXT"'}
    assert msdos.value == 1.458255915e9
    (quoted,) = e.samples("quoted")
    assert quoted.labels == {"a": 'x}y, z="w"', "b": "#not a comment"} and quoted.value == math.inf
    (weird,) = e.samples("something_weird")
    assert weird.value == -math.inf and weird.timestamp_ms == -3982045
    assert math.isnan(e.samples("nan_gauge")[0].value)
    assert e.total("nan_gauge") is None  # NaN is unknown, not a number to add up
    assert e.total("metric_without_timestamp_and_labels") == 12.47


def test_histogram_and_summary_samples_belong_to_their_declared_family() -> None:
    e = parse(MESSY)
    hist = e.families["http_request_duration_seconds"]
    assert hist.type == "histogram"
    assert [s.name for s in hist.samples] == ["http_request_duration_seconds_bucket"] * 3 + [
        "http_request_duration_seconds_sum", "http_request_duration_seconds_count"]
    assert [s.labels["le"] for s in e.samples("http_request_duration_seconds_bucket")] == ["0.05", "0.1", "+Inf"]
    summary = e.families["rpc_duration_seconds"]
    assert summary.type == "summary" and len(summary.samples) == 4
    assert e.total("rpc_duration_seconds_count") == 2693


def test_a_counter_is_found_with_or_without_its_total_suffix() -> None:
    e = parse(MESSY + "# TYPE legacy_hits counter\nlegacy_hits 4\n")
    assert e.total("http_requests") == 1027 + 3 + 5
    assert e.total("http_requests_total") == 1027 + 3 + 5
    assert e.total("legacy_hits_total") == 4
    assert e.total("exemplary") == 7  # the exemplar after '#' is not the value


def test_prometheus_client_writes_counters_as_total_with_a_created_sample_in_the_same_family() -> None:
    text = "# HELP c_total help\n# TYPE c_total counter\nc_total 3.0\nc_created 1.7e9\n"
    family = parse(text).families["c_total"]
    assert [s.name for s in family.samples] == ["c_total", "c_created"]


def test_keep_skips_families_unparsed_even_when_their_lines_would_not_parse() -> None:
    text = '# TYPE vllm:a gauge\nvllm:a 1\n# TYPE other gauge\nother{broken="} 2\n'
    e = parse(text, lambda family: family.startswith("vllm:"))
    assert e.total("vllm:a") == 1 and "other" in e.families and e.families["other"].samples == []
    with pytest.raises(PromParseError) as err:
        parse(text)
    assert err.value.line_no == 4


@pytest.mark.parametrize("line", [
    "no_value", 'bad{a="1" b="2"} 1', 'bad{a=1} 1', "bad 1_000", "bad one", "1bad 1", "bad 1 2 3",
    'bad{a="unterminated} 1',
])
def test_malformed_lines_fail_the_parse_and_name_the_line(line: str) -> None:
    with pytest.raises(PromParseError) as err:
        parse(f"ok 1\n{line}\n")
    assert err.value.line_no == 2 and err.value.line == line


@pytest.mark.parametrize("text", [
    samples.VLLM_METRICS, samples.vllm_metrics(model_name=samples.MESSY_MODEL_NAME, kv_usage="NaN"),
    samples.SGLANG_METRICS, samples.sglang_metrics(model_name=samples.MESSY_MODEL_NAME, token_usage="NaN"),
], ids=["vllm", "vllm-messy", "sglang", "sglang-messy"])
def test_the_engine_expositions_read_like_prometheus_client_reads_them(text: str) -> None:
    ours = parse(text)
    theirs = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert len(theirs) == sum(len(f.samples) for f in ours.families.values())
    for sample in theirs:
        (match,) = [s for s in ours.samples(sample.name) if dict(s.labels) == sample.labels]
        assert match.value == sample.value or (math.isnan(match.value) and math.isnan(sample.value)), sample
        assert match.timestamp_ms == (None if sample.timestamp is None else round(float(sample.timestamp) * 1000))


def test_vllm_labels_and_timestamps_come_through_unescaped() -> None:
    ours = parse(samples.vllm_metrics(model_name=samples.MESSY_MODEL_NAME))
    info = ours.samples("vllm:cache_config_info")[0].labels
    assert info["num_gpu_blocks"] == "2000" and info["swap_space"] == "4"
    (running,) = ours.samples("vllm:num_requests_running")
    assert running.labels == {"engine": "0", "model_name": 'acme/"fast", {8B} \\ fp8'} and running.value == 3
    (waiting,) = ours.samples("vllm:num_requests_waiting")
    assert waiting.timestamp_ms == 1_700_000_000_000
    preemptions = ours.families["vllm:num_preemptions"]  # TYPE without _total: its _total and _created samples
    assert preemptions.type == "counter"
    assert [s.name for s in preemptions.samples] == ["vllm:num_preemptions_total", "vllm:num_preemptions_created"]


# ---- round trip against services/common/prom.py's writer --------------------------------------------------------

_names = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,20}", fullmatch=True).filter(
    lambda n: not n.endswith(("_total", "_bucket", "_sum", "_count", "_created", "_info")))
_label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,10}", fullmatch=True).filter(lambda n: n != "le")
_values = st.one_of(st.integers(-10**12, 10**12), st.floats(allow_nan=True, allow_infinity=True))
_labels = st.dictionaries(_label_names, st.text(max_size=20), max_size=4)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_names, st.tuples(st.sampled_from(["gauge", "counter", "histogram"]), _labels, _values,
                                         st.lists(st.floats(0, 100), max_size=5)), min_size=1, max_size=6))
def test_whatever_our_writer_writes_parses_back_to_the_same_samples(spec: dict) -> None:  # type: ignore[type-arg]
    w = PromText()
    expected = []
    for name, (kind, labels, value, observations) in spec.items():
        if kind == "gauge":
            w.gauge(name, "help text", value, labels)
            expected.append((name, labels, float(value)))
        elif kind == "counter":
            w.counter(name + "_total", "a counter", value, labels)
            expected.append((name + "_total", labels, float(value)))
        else:
            hist = Histogram((0.5, 1.0, 10.0))
            for x in observations:
                hist.observe(x)
            w.histogram(name, "a histogram", hist, labels)
            expected.append((name + "_count", labels, float(hist.count)))
    e = parse(w.render())
    for name, labels, value in expected:
        matches = [s for s in e.samples(name) if dict(s.labels) == labels]
        assert len(matches) == 1, (name, labels)
        got = matches[0].value
        assert (math.isnan(got) and math.isnan(value)) or got == value
