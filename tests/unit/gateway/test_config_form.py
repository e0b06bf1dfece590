"""The Config page's form ↔ pools file mapping. Pure."""

from __future__ import annotations

from proto import pools as pool_config
from services.common.runtime import ConfigError
from services.gateway import config_form

CURRENT = pool_config.to_dict(pool_config.parse({
    "model_pools": {"tiny": {"members": [{"model_id": "tiny", "backend": "bus:w1", "capacity_weight": 4},
                                         {"model_id": "tiny", "backend": "http://gpu1:8006"}]}},
    "price_book": {"tiny": {"prompt_usd_per_m": 0.2, "output_usd_per_m": 0.8}},
    "metrics": {"stale_threshold": 4.0},
}))


def _form_of(raw: dict) -> dict[str, str]:
    """What a browser posts for the page rendered from ``raw`` (no edits)."""
    view = config_form.view_model(raw)
    form: dict[str, str] = {"electricity_rate_usd_per_kwh": str(view["rate"])}
    for i, p in enumerate(view["pools"]):
        form[f"pool.{i}.name"] = p["name"]
        for k in ("overflow_threshold", "sticky_bias", "capacity_bias"):
            form[f"pool.{i}.{k}"] = str(p[k])
        if p["cache_affinity"]:
            form[f"pool.{i}.cache_affinity"] = "on"
        form[f"pool.{i}.aliases"] = p["aliases"]
        for j, m in enumerate(p["members"]):
            for k in ("backend", "model_id", "capacity_weight"):
                form[f"pool.{i}.member.{j}.{k}"] = str(m[k])
            form[f"pool.{i}.member.{j}.max_context"] = "" if m["max_context"] is None else str(m["max_context"])
        form[f"pool.{i}.member.new.backend"] = ""
    for k, row in enumerate(view["prices"]):
        form[f"price.{k}.model"] = row["model"]
        for f in ("prompt_usd_per_m", "cached_usd_per_m", "output_usd_per_m"):
            form[f"price.{k}.{f}"] = "" if row[f] is None else str(row[f])
    return form


def test_an_unedited_form_gives_back_the_same_config() -> None:
    result = config_form.from_form(_form_of(CURRENT), CURRENT)
    assert not result.errors
    assert pool_config.parse(result.raw) == pool_config.parse(CURRENT)
    assert result.raw["metrics"]["stale_threshold"] == 4.0  # sections the page does not show are kept


def test_edits_add_and_remove_members_and_pools() -> None:
    form = _form_of(CURRENT)
    form["pool.0.member.0.capacity_weight"] = "0.5"
    form["pool.0.member.1.remove"] = "on"
    form["pool.0.member.new.backend"] = "bus:w9"
    form["pool.0.member.new.model_id"] = "tiny"
    form["newpool.name"] = "big"
    form["newpool.backend"] = "http://gpu2:8000"
    form["price.0.model"] = ""  # drop the row
    parsed = pool_config.parse(config_form.from_form(form, CURRENT).raw)
    assert [(m.backend, m.capacity_weight) for m in parsed.pools["tiny"].members] == [("bus:w1", 0.5),
                                                                                      ("bus:w9", 1.0)]
    assert parsed.pools["big"].members[0].model_id == "big" and parsed.price_book == {}


def test_errors_land_on_the_field_that_caused_them() -> None:
    form = _form_of(CURRENT)
    form["pool.0.member.1.backend"] = "ftp://nope"
    result = config_form.from_form(form, CURRENT)
    try:
        pool_config.parse(result.raw)
    except ConfigError as exc:
        assert result.field_for(exc.key) == "pool.0.member.1.backend"
    else:
        raise AssertionError("a bad backend must not parse")
    form = _form_of(CURRENT)
    form["pool.0.overflow_threshold"] = "1.5"
    result = config_form.from_form(form, CURRENT)
    try:
        pool_config.parse(result.raw)
    except ConfigError as exc:
        assert result.field_for(exc.key) == "pool.0.overflow_threshold"
    form = _form_of(CURRENT)
    form["pool.0.member.0.capacity_weight"] = "lots"
    assert config_form.from_form(form, CURRENT).errors == {"pool.0.member.0.capacity_weight": "must be a number"}



def test_a_save_keeps_what_the_page_does_not_show_max_seqs_and_upstream_knobs() -> None:
    current = pool_config.to_dict(pool_config.parse({
        "model_pools": {"v": {"members": [{"model_id": "v", "backend": "http://gpu1:8000", "max_seqs": 48}],
                              "max_pool_share": 0.6}},
        "metrics": {"default_max_seqs": 8, "backend_max_seqs": {"http://gpu1:8000": 40}},
    }))
    parsed = pool_config.parse(config_form.from_form(_form_of(current), current).raw)
    assert parsed.pools["v"].members[0].max_seqs == 48 and parsed.pools["v"].max_pool_share == 0.6
    assert parsed.metrics.default_max_seqs == 8 and parsed.metrics.backend_max_seqs == {"http://gpu1:8000": 40}
