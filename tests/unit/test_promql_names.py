"""The PromQL reader the dashboard and alert-rule tests use (tests/promql_names.py): what it counts as a metric
name, and what it must not."""

from __future__ import annotations

import pytest

from tests.promql_names import PromQLError, metric_names, missing_names, template_query_names


@pytest.mark.parametrize(("expr", "names"), [
    # the official vLLM dashboard's shapes (examples/online_serving/prometheus_grafana/grafana.json)
    ('histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}'
     '[$__rate_interval])))', {"vllm:e2e_request_latency_seconds_bucket"}),
    ('rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
     'rate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
     {"vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"}),
    ('sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
     {"vllm:request_success_total"}),
    # the modifier after the aggregated expression; a label list of several names
    ("sum(rate(a_total[5m])) by (model, member)", {"a_total"}),
    ("sum without (instance, job) (b)", {"b"}),
    # vector matching: label lists of on/ignoring/group_left/group_right are labels, not metrics
    ("a * on(instance) group_left(model_name) b", {"a", "b"}),
    ("a / ignoring(code) group_right c", {"a", "c"}),
    ("sum(rate(x[30m]) and on(instance) (rate(y[30m]) > 0)) or vector(0)", {"x", "y"}),
    # set operators, bool, comparison, arithmetic
    ("a unless b or c > bool 0", {"a", "b", "c"}),
    ("(a + b) % 2 ^ c", {"a", "b", "c"}),
    # offset, @ and subqueries; durations are not names
    ("rate(x[5m] offset 1h) > 1e-9 and y @ start()", {"x", "y"}),
    ("max_over_time(deriv(q[10m])[1h30m:5m])", {"q"}),
    # aggregations with parameters; string parameters are not names
    ('topk(5, sum by (api_key_id) (rate(t_total[1m])))', {"t_total"}),
    ('count_values("version", build_info)', {"build_info"}),
    ('label_replace(up, "svc", "$1", "instance", "(.*):.*")', {"up"}),
    # braces, parentheses and metric-like text inside strings and matchers hide nothing and add nothing
    ('x{job="a}b", path=~"sum(y) or z"}', {"x"}),
    ("x{job='it\\'s'} + w{k=`raw \\`}", {"x", "w"}),
    # the metric named inside the braces
    ('{__name__="foo", job="x"}', {"foo"}),
    # Grafana's template variables
    ("rate(x{m=~\"$model\"}[$__rate_interval]) * ${factor} + y[[interval]]", {"x", "y"}),
    # Inf and NaN are numbers; comments end at the line
    ("x > Inf or clamp_min(y, NaN) # not_a_metric here\n", {"x", "y"}),
    ("1 + 2", set()),
])
def test_metric_names_are_the_identifiers_in_selector_position(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


@pytest.mark.parametrize("expr", [
    "sum(rate(x[5m])",  # unbalanced parenthesis
    "rate(x[5m)",  # unbalanced bracket
    'x{job="a}',  # unterminated string inside matchers
    '{__name__=~"vllm:.*"}',  # a regex name matcher names no finite set
    "x ; y",  # not PromQL
])
def test_what_it_cannot_take_apart_is_refused_not_guessed(expr: str) -> None:
    with pytest.raises(PromQLError):
        metric_names(expr)


@pytest.mark.parametrize(("query", "names"), [
    ("label_values(llmgw_model_requests_total, model)", {"llmgw_model_requests_total"}),
    ('label_values(vllm:num_requests_running{job="ninfer"}, model_name)', {"vllm:num_requests_running"}),
    ("label_values(model)", set()),
    ("label_names()", set()),
    ("query_result(topk(3, llmgw_member_load_score))", {"llmgw_member_load_score"}),
])
def test_template_variable_queries_read_the_metric_of_their_selector(query: str, names: set[str]) -> None:
    assert template_query_names(query) == names


def test_a_name_is_defined_by_a_present_series_or_by_a_declared_family_of_the_type_it_implies() -> None:
    families = {"h": "histogram", "s": "summary", "c": "counter", "g": "gauge", "empty_c": "counter"}
    samples = {"h_bucket", "h_sum", "h_count", "c_total", "g"}
    assert missing_names({"h_bucket", "h_sum", "c_total", "g", "empty_c_total"}, families, samples) == set()
    assert missing_names({"s_sum", "s_count"}, families, set()) == set()  # a summary has _sum and _count
    # a summary has no buckets; a counter's series ends in _total; a bare histogram or counter name selects nothing
    assert missing_names({"s_bucket", "c", "h", "absent", "g_total"}, families, samples) == {
        "s_bucket", "c", "h", "absent", "g_total"}
