"""The ledger's tables, views and rollup statements (documented table by table in docs/accounting.md).

Raw tables hold what arrived (deduplicated by message identity); derived tables are recomputed from
them, so a late or duplicate message can always be replayed into the same result. Energy is stored in
joules and shown in kWh (J / 3.6e6). A NULL energy means "not measured", never 0.
"""

from __future__ import annotations

TABLES = """
CREATE TABLE IF NOT EXISTS requests (
    request_id      VARCHAR PRIMARY KEY,
    ts              TIMESTAMPTZ NOT NULL,
    gateway_id      VARCHAR NOT NULL,
    gateway_session VARCHAR NOT NULL,
    gateway_seq     BIGINT NOT NULL,
    model           VARCHAR NOT NULL,
    pool            VARCHAR NOT NULL,
    member          VARCHAR,
    worker_id       VARCHAR,
    api_key_id      VARCHAR,
    endpoint        VARCHAR,
    stream          BOOLEAN,
    status          VARCHAR NOT NULL,
    http_status     INTEGER,
    finish_reason   VARCHAR,
    error_code      VARCHAR,
    prompt_tokens   BIGINT NOT NULL,
    cached_tokens   BIGINT NOT NULL,
    output_tokens   BIGINT NOT NULL,
    ttft_ms         DOUBLE,
    latency_ms      DOUBLE,
    routing_reason  VARCHAR,
    ingested_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- Appended after ingested_at, where MIGRATIONS' ADD COLUMN puts them, so a new ledger and a migrated
    -- one have the same column order (SELECT * reads alike). UsageRecord's appended fields:
    usage_source    VARCHAR,            -- 'member' | 'engine' | 'counted_by_gateway' | 'none' (or newer)
    limit_kind      VARCHAR,            -- the limit a 429 came from (tokens_per_day, kwh_per_month, ...)
    user_id         VARCHAR             -- the user owning api_key_id
);
CREATE TABLE IF NOT EXISTS sample_log (
    worker_id   VARCHAR NOT NULL,
    session_id  VARCHAR NOT NULL,
    seq         BIGINT NOT NULL,
    ts          TIMESTAMPTZ NOT NULL,
    model_id    VARCHAR NOT NULL,
    ingested_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (worker_id, session_id, seq)
);
CREATE TABLE IF NOT EXISTS energy_samples (
    worker_id    VARCHAR NOT NULL,
    session_id   VARCHAR NOT NULL,
    seq          BIGINT NOT NULL,
    device_id    VARCHAR NOT NULL,
    ts           TIMESTAMPTZ NOT NULL,
    kind         VARCHAR NOT NULL,
    method       VARCHAR NOT NULL,
    energy_mj    BIGINT,
    max_range_mj BIGINT,
    power_mw     BIGINT,
    PRIMARY KEY (worker_id, session_id, seq, device_id),
    -- Appended (COLUMN_MIGRATIONS adds them to an older ledger, in this order): the counter in µJ when the
    -- sender has it (RAPL); NULL from NVML and from senders older than EnergyReading.energy_uj.
    energy_uj    BIGINT,
    max_range_uj BIGINT
);
CREATE TABLE IF NOT EXISTS sample_tokens (
    worker_id     VARCHAR NOT NULL,
    session_id    VARCHAR NOT NULL,
    seq           BIGINT NOT NULL,
    request_id    VARCHAR NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    output_tokens BIGINT NOT NULL,
    PRIMARY KEY (worker_id, session_id, seq, request_id)
);
CREATE TABLE IF NOT EXISTS energy_intervals (
    -- One row per *part*: the share of one device interval (two consecutive readings of the device, from
    -- any workers and sessions) owned by one worker x model (docs/accounting.md, "Intervals"). energy_j and
    -- device_s are the part's (weight x the interval's); the interval is (device_id, end_worker_id,
    -- end_session_id, end_seq), the reading that ends it.
    worker_id      VARCHAR NOT NULL,   -- the part's owner
    session_id     VARCHAR NOT NULL,
    device_id      VARCHAR NOT NULL,
    start_seq      BIGINT NOT NULL,
    end_seq        BIGINT NOT NULL,
    start_ts       TIMESTAMPTZ NOT NULL,
    end_ts         TIMESTAMPTZ NOT NULL,
    model_id       VARCHAR NOT NULL,
    kind           VARCHAR NOT NULL,
    method         VARCHAR NOT NULL,
    energy_j       DOUBLE,
    device_s       DOUBLE NOT NULL,
    is_reset       BOOLEAN NOT NULL,
    is_wrap        BOOLEAN NOT NULL,
    is_gap         BOOLEAN NOT NULL,
    is_implausible BOOLEAN NOT NULL,
    -- The owner's tokens in this interval (fractions of its windows'), on its windows' token carrier (the
    -- smallest device_id a sample lists) only: 0 on other devices' rows, so a sum counts each token once.
    prompt_tokens  DOUBLE NOT NULL,
    output_tokens  DOUBLE NOT NULL,
    is_rapl_ambiguous  BOOLEAN,
    is_busy            BOOLEAN,
    is_window_measured BOOLEAN,
    start_worker_id    VARCHAR NOT NULL,  -- the reading that starts the interval
    start_session_id   VARCHAR NOT NULL,
    end_worker_id      VARCHAR NOT NULL,  -- the reading that ends it
    end_session_id     VARCHAR NOT NULL,
    weight             DOUBLE NOT NULL,   -- the part's fraction of the interval (parts sum to 1)
    interval_energy_j  DOUBLE,            -- the whole interval's energy (NULL when unknown)
    PRIMARY KEY (device_id, end_worker_id, end_session_id, end_seq, worker_id, session_id, model_id)
);
CREATE TABLE IF NOT EXISTS energy_attribution (
    worker_id     VARCHAR NOT NULL,   -- the request's worker (the part's owner)
    session_id    VARCHAR NOT NULL,
    device_id     VARCHAR NOT NULL,
    end_seq       BIGINT NOT NULL,
    start_ts      TIMESTAMPTZ NOT NULL,
    end_ts        TIMESTAMPTZ NOT NULL,
    model_id      VARCHAR NOT NULL,
    method        VARCHAR NOT NULL,
    request_id    VARCHAR,            -- NULL: the idle share, which belongs to the engine/model
    energy_j      DOUBLE,             -- NULL: the interval's energy is unknown (the share still has tokens)
    prompt_tokens DOUBLE NOT NULL,    -- on the window's token carrier only, as in energy_intervals
    output_tokens DOUBLE NOT NULL,
    is_window_measured BOOLEAN,
    end_worker_id  VARCHAR NOT NULL,  -- with device_id and end_seq: the interval
    end_session_id VARCHAR NOT NULL
);
CREATE TABLE IF NOT EXISTS parked (
    stream     VARCHAR NOT NULL,
    subject    VARCHAR NOT NULL,
    stream_seq BIGINT,
    reason     VARCHAR NOT NULL,
    payload    BLOB,
    parked_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS tariff (
    effective_from TIMESTAMPTZ PRIMARY KEY,
    usd_per_kwh    DOUBLE NOT NULL,
    source         VARCHAR NOT NULL
);
CREATE TABLE IF NOT EXISTS price_book (
    model_id         VARCHAR PRIMARY KEY,  -- '*' applies to models without a row of their own
    prompt_usd_per_m DOUBLE NOT NULL,
    cached_usd_per_m DOUBLE NOT NULL,
    output_usd_per_m DOUBLE NOT NULL,
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS rollup_dirty (hour TIMESTAMPTZ PRIMARY KEY);
CREATE TABLE IF NOT EXISTS energy_hourly (
    hour TIMESTAMPTZ NOT NULL, worker_id VARCHAR NOT NULL, model_id VARCHAR NOT NULL, method VARCHAR NOT NULL,
    measured_j DOUBLE, estimated_j DOUBLE, busy_j DOUBLE, idle_j DOUBLE, busy_output_tokens DOUBLE,
    device_s DOUBLE NOT NULL, covered_s DOUBLE NOT NULL, energy_usd DOUBLE,
    num_intervals BIGINT NOT NULL, num_reset BIGINT NOT NULL, num_wrap BIGINT NOT NULL, num_gap BIGINT NOT NULL,
    num_implausible BIGINT NOT NULL,
    num_rapl_ambiguous BIGINT, jpt_busy_j DOUBLE, output_tokens DOUBLE  -- appended (COLUMN_MIGRATIONS)
);
CREATE TABLE IF NOT EXISTS energy_daily (
    day DATE NOT NULL, worker_id VARCHAR NOT NULL, model_id VARCHAR NOT NULL, method VARCHAR NOT NULL,
    measured_j DOUBLE, estimated_j DOUBLE, busy_j DOUBLE, idle_j DOUBLE, busy_output_tokens DOUBLE,
    device_s DOUBLE NOT NULL, covered_s DOUBLE NOT NULL, energy_usd DOUBLE,
    num_intervals BIGINT NOT NULL, num_reset BIGINT NOT NULL, num_wrap BIGINT NOT NULL, num_gap BIGINT NOT NULL,
    num_implausible BIGINT NOT NULL,
    num_rapl_ambiguous BIGINT, jpt_busy_j DOUBLE, output_tokens DOUBLE  -- appended (COLUMN_MIGRATIONS)
);
CREATE TABLE IF NOT EXISTS key_energy_hourly (
    hour TIMESTAMPTZ NOT NULL, worker_id VARCHAR NOT NULL, model_id VARCHAR NOT NULL, pool VARCHAR,
    api_key_id VARCHAR, busy_j DOUBLE, estimated_j DOUBLE, output_tokens DOUBLE NOT NULL, energy_usd DOUBLE,
    method VARCHAR, measured_output_tokens DOUBLE,
    jpt_busy_j DOUBLE  -- appended (COLUMN_MIGRATIONS)
);
CREATE TABLE IF NOT EXISTS key_energy_daily (
    day DATE NOT NULL, worker_id VARCHAR NOT NULL, model_id VARCHAR NOT NULL, pool VARCHAR,
    api_key_id VARCHAR, busy_j DOUBLE, estimated_j DOUBLE, output_tokens DOUBLE NOT NULL, energy_usd DOUBLE,
    method VARCHAR, measured_output_tokens DOUBLE,
    jpt_busy_j DOUBLE  -- appended (COLUMN_MIGRATIONS)
);
CREATE TABLE IF NOT EXISTS usage_hourly (
    hour TIMESTAMPTZ NOT NULL, model VARCHAR NOT NULL, pool VARCHAR NOT NULL, worker_id VARCHAR,
    api_key_id VARCHAR, status VARCHAR NOT NULL, num_requests BIGINT NOT NULL, prompt_tokens BIGINT NOT NULL,
    cached_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS usage_daily (
    day DATE NOT NULL, model VARCHAR NOT NULL, pool VARCHAR NOT NULL, worker_id VARCHAR,
    api_key_id VARCHAR, status VARCHAR NOT NULL, num_requests BIGINT NOT NULL, prompt_tokens BIGINT NOT NULL,
    cached_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL
);
"""

# A ledger written by an older version: the same tables as above, brought up to date in place
# (each statement is a no-op on a current ledger). Key rows from before ``method`` existed keep it NULL;
# their tokens were all from measured intervals then. Requests stored before usage_source, limit_kind and
# user_id existed keep them NULL: the ledger did not record them (a record from an old gateway that arrives
# now decodes with UsageRecord's defaults, usage_source 'member').
MIGRATIONS = """
ALTER TABLE requests ADD COLUMN IF NOT EXISTS usage_source VARCHAR;
ALTER TABLE requests ADD COLUMN IF NOT EXISTS limit_kind VARCHAR;
ALTER TABLE requests ADD COLUMN IF NOT EXISTS user_id VARCHAR;
ALTER TABLE energy_attribution ALTER COLUMN energy_j DROP NOT NULL;
ALTER TABLE key_energy_hourly ADD COLUMN IF NOT EXISTS method VARCHAR;
ALTER TABLE key_energy_hourly ADD COLUMN IF NOT EXISTS measured_output_tokens DOUBLE;
ALTER TABLE key_energy_daily ADD COLUMN IF NOT EXISTS method VARCHAR;
ALTER TABLE key_energy_daily ADD COLUMN IF NOT EXISTS measured_output_tokens DOUBLE;
UPDATE key_energy_hourly SET measured_output_tokens = output_tokens WHERE measured_output_tokens IS NULL;
UPDATE key_energy_daily SET measured_output_tokens = output_tokens WHERE measured_output_tokens IS NULL;
"""

# Steps that add columns and fill them on a ledger that lacks them: each runs once, in one transaction,
# when its (table, column) is missing (store.py checks). Appending keeps a migrated table's column order
# that of a new one. An old ledger's raw intervals put a sample's tokens on every device and knew no
# RAPL ambiguity: their tokens move to the window's token carrier (the smallest device_id), their busy
# and window-measured flags come from the window's rows (a device missing from one of the two samples is
# not seen any more: such a window counts as measured when its rows are), and every hour they touch is
# marked dirty, so the next refresh rolls it up again by the new rules. Rollup rows older than the raw
# retention cannot be recomputed: they keep J per token over all their busy energy and tokens (jpt_busy_j
# = busy_j, output_tokens = busy_output_tokens), as they were counted.
COLUMN_MIGRATIONS: tuple[tuple[str, str, str], ...] = (
    ("energy_samples", "energy_uj", """
ALTER TABLE energy_samples ADD COLUMN energy_uj BIGINT;
ALTER TABLE energy_samples ADD COLUMN max_range_uj BIGINT;
"""),
    ("energy_intervals", "is_window_measured", """
ALTER TABLE energy_intervals ADD COLUMN is_rapl_ambiguous BOOLEAN;
ALTER TABLE energy_intervals ADD COLUMN is_busy BOOLEAN;
ALTER TABLE energy_intervals ADD COLUMN is_window_measured BOOLEAN;
ALTER TABLE energy_attribution ADD COLUMN is_window_measured BOOLEAN;
INSERT OR IGNORE INTO rollup_dirty
SELECT DISTINCT unnest(generate_series(date_trunc('hour', least(start_ts, end_ts)),
                                       date_trunc('hour', greatest(start_ts, end_ts)), INTERVAL 1 HOUR))
FROM energy_intervals;
CREATE OR REPLACE TEMP TABLE migrated_windows AS
SELECT worker_id, session_id, end_seq, min(device_id) AS carrier,
       bool_or(prompt_tokens + output_tokens > 0) AS is_busy,
       bool_and(energy_j IS NOT NULL AND method <> 'estimated') AS is_window_measured
FROM energy_intervals GROUP BY ALL;
UPDATE energy_intervals SET is_rapl_ambiguous = false, is_busy = w.is_busy, is_window_measured = w.is_window_measured,
       prompt_tokens = CASE WHEN device_id = w.carrier THEN prompt_tokens ELSE 0 END,
       output_tokens = CASE WHEN device_id = w.carrier THEN output_tokens ELSE 0 END
FROM migrated_windows w
WHERE energy_intervals.worker_id = w.worker_id AND energy_intervals.session_id = w.session_id
  AND energy_intervals.end_seq = w.end_seq;
UPDATE energy_attribution SET is_window_measured = w.is_window_measured,
       prompt_tokens = CASE WHEN device_id = w.carrier THEN prompt_tokens ELSE 0 END,
       output_tokens = CASE WHEN device_id = w.carrier THEN output_tokens ELSE 0 END
FROM migrated_windows w
WHERE energy_attribution.worker_id = w.worker_id AND energy_attribution.session_id = w.session_id
  AND energy_attribution.end_seq = w.end_seq;
DROP TABLE migrated_windows;
"""),
    ("energy_hourly", "jpt_busy_j", """
ALTER TABLE energy_hourly ADD COLUMN num_rapl_ambiguous BIGINT;
ALTER TABLE energy_hourly ADD COLUMN jpt_busy_j DOUBLE;
ALTER TABLE energy_hourly ADD COLUMN output_tokens DOUBLE;
UPDATE energy_hourly SET num_rapl_ambiguous = 0, jpt_busy_j = busy_j, output_tokens = busy_output_tokens;
ALTER TABLE energy_daily ADD COLUMN num_rapl_ambiguous BIGINT;
ALTER TABLE energy_daily ADD COLUMN jpt_busy_j DOUBLE;
ALTER TABLE energy_daily ADD COLUMN output_tokens DOUBLE;
UPDATE energy_daily SET num_rapl_ambiguous = 0, jpt_busy_j = busy_j, output_tokens = busy_output_tokens;
ALTER TABLE key_energy_hourly ADD COLUMN jpt_busy_j DOUBLE;
UPDATE key_energy_hourly SET jpt_busy_j = busy_j;
ALTER TABLE key_energy_daily ADD COLUMN jpt_busy_j DOUBLE;
UPDATE key_energy_daily SET jpt_busy_j = busy_j;
"""),
)

# Query-time views for operators: kWh and $ next to their coverage. List-price value uses the current
# price book (a model without its own row takes the '*' row).
VIEWS = """
-- J per output token is over the windows in which every device of the worker was measured (jpt_busy_j
-- over busy_output_tokens); token_coverage_pct is the share of the output tokens those windows hold.
CREATE OR REPLACE VIEW daily_energy AS
SELECT day, worker_id, model_id,
       sum(measured_j) / 3.6e6 AS kwh,
       sum(energy_usd) AS energy_usd,
       sum(estimated_j) / 3.6e6 AS estimated_kwh,
       sum(busy_j) / 3.6e6 AS busy_kwh,
       sum(idle_j) / 3.6e6 AS idle_kwh,
       sum(jpt_busy_j) / nullif(sum(busy_output_tokens), 0) AS j_per_output_token,
       100.0 * sum(covered_s) / nullif(sum(device_s), 0) AS coverage_pct,
       list(DISTINCT method ORDER BY method) AS methods,
       sum(num_reset) AS num_reset, sum(num_wrap) AS num_wrap, sum(num_gap) AS num_gap,
       sum(num_implausible) AS num_implausible,
       sum(num_rapl_ambiguous) AS num_rapl_ambiguous,
       sum(output_tokens) AS output_tokens,
       100.0 * sum(busy_output_tokens) / nullif(sum(output_tokens), 0) AS token_coverage_pct
FROM energy_daily GROUP BY ALL;

CREATE OR REPLACE VIEW daily_usage AS
SELECT u.day, u.model, u.pool, u.worker_id, u.api_key_id,
       sum(u.num_requests) AS num_requests, sum(u.prompt_tokens) AS prompt_tokens,
       sum(u.cached_tokens) AS cached_tokens, sum(u.output_tokens) AS output_tokens,
       sum(((u.prompt_tokens - u.cached_tokens) * coalesce(p.prompt_usd_per_m, d.prompt_usd_per_m)
            + u.cached_tokens * coalesce(p.cached_usd_per_m, d.cached_usd_per_m)
            + u.output_tokens * coalesce(p.output_usd_per_m, d.output_usd_per_m)) / 1e6) AS list_value_usd
FROM usage_daily u
LEFT JOIN price_book p ON p.model_id = u.model
LEFT JOIN price_book d ON d.model_id = '*'
GROUP BY ALL;

CREATE OR REPLACE VIEW daily_key_energy AS
SELECT day, pool, api_key_id, model_id, sum(busy_j) / 3.6e6 AS busy_kwh, sum(energy_usd) AS energy_usd,
       sum(jpt_busy_j) / nullif(sum(measured_output_tokens), 0) AS j_per_output_token,
       100.0 * sum(measured_output_tokens) / nullif(sum(output_tokens), 0) AS coverage_pct,
       list(DISTINCT method ORDER BY method) FILTER (method IS NOT NULL) AS methods
FROM key_energy_daily GROUP BY ALL;

CREATE OR REPLACE VIEW rolling_30d AS
SELECT worker_id, model_id,
       sum(measured_j) / 3.6e6 AS kwh, sum(energy_usd) AS energy_usd,
       sum(jpt_busy_j) / nullif(sum(busy_output_tokens), 0) AS j_per_output_token,
       100.0 * sum(covered_s) / nullif(sum(device_s), 0) AS coverage_pct,
       list(DISTINCT method ORDER BY method) AS methods,
       sum(estimated_j) / 3.6e6 AS estimated_kwh,
       100.0 * sum(busy_output_tokens) / nullif(sum(output_tokens), 0) AS token_coverage_pct
FROM energy_daily WHERE day > current_date - 30 GROUP BY ALL;
"""

# One interval split over the UTC hours it overlaps, in proportion to time (an interval of zero or
# negative length lands whole in the hour of its end). Durations are whole microseconds subtracted as
# integers (epoch_us), exactly as stored, never differences of float epoch seconds (which lose ~2e-7 s at
# today's epoch). $1, $2: the [lo, hi) range of hours wanted; {hours}: a query naming the hours wanted.
_PIECES = """
WITH iv AS (
    SELECT *, epoch_us(end_ts) - epoch_us(start_ts) AS dur_us FROM {table} WHERE end_ts >= $1 AND start_ts < $2
), pieces AS (
    SELECT iv.*, h.hour,
           CASE WHEN dur_us <= 0 THEN 1.0
                ELSE (epoch_us(least(end_ts, h.hour + INTERVAL 1 HOUR)) - epoch_us(greatest(start_ts, h.hour)))
                     / dur_us
           END AS frac
    FROM iv, LATERAL (
        SELECT unnest(generate_series(
            CASE WHEN dur_us <= 0 THEN date_trunc('hour', end_ts) ELSE date_trunc('hour', start_ts) END,
            CASE WHEN dur_us <= 0 THEN date_trunc('hour', end_ts)
                 ELSE date_trunc('hour', end_ts - INTERVAL 1 MICROSECOND) END,
            INTERVAL 1 HOUR)) AS hour
    ) h
    WHERE h.hour IN ({hours})
)
"""

# The electricity rate in force at each hour (ASOF: the newest tariff row not after the hour).
_RATED = """
, rated AS (
    SELECT agg.*, t.usd_per_kwh FROM agg ASOF LEFT JOIN tariff t ON agg.hour >= t.effective_from
)
"""

# Energy sums over every device's row; tokens are on one row per window (its token carrier), so they are
# counted once however many devices the worker has. Busy or idle is the window's (is_busy on every row).
# J per output token (docs/accounting.md, "Rollups"): jpt_busy_j and busy_output_tokens are taken over the
# windows in which every device was measured, so a window where one GPU's reading is missing adds neither
# its tokens nor its measured devices' energy to it (that energy still counts in measured_j and busy_j).
_ENERGY_COLUMNS = ("measured_j, estimated_j, busy_j, idle_j, busy_output_tokens, device_s, covered_s, energy_usd, "
                   "num_intervals, num_reset, num_wrap, num_gap, num_implausible, num_rapl_ambiguous, jpt_busy_j, "
                   "output_tokens")
REFRESH_ENERGY_HOURLY = _PIECES.format(table="energy_intervals", hours="SELECT hour FROM dirty_now") + """
, agg AS (
    SELECT hour, worker_id, model_id, method,
           sum(energy_j * frac) FILTER (method <> 'estimated') AS measured_j,
           sum(energy_j * frac) FILTER (method = 'estimated') AS estimated_j,
           sum(energy_j * frac) FILTER (method <> 'estimated' AND is_busy) AS busy_j,
           sum(energy_j * frac) FILTER (method <> 'estimated' AND NOT is_busy) AS idle_j,
           sum(energy_j * frac) FILTER (is_busy AND is_window_measured) AS jpt_busy_j,
           sum(output_tokens * frac) FILTER (is_window_measured) AS busy_output_tokens,
           sum(output_tokens * frac) AS output_tokens,
           sum(device_s * frac) AS device_s,
           coalesce(sum(device_s * frac) FILTER (method <> 'estimated' AND energy_j IS NOT NULL), 0) AS covered_s,
           count(*) AS num_intervals, count(*) FILTER (is_reset) AS num_reset, count(*) FILTER (is_wrap) AS num_wrap,
           count(*) FILTER (is_gap) AS num_gap, count(*) FILTER (is_implausible) AS num_implausible,
           count(*) FILTER (is_rapl_ambiguous) AS num_rapl_ambiguous
    FROM pieces GROUP BY ALL
)""" + _RATED + f"""
INSERT INTO energy_hourly (hour, worker_id, model_id, method, {_ENERGY_COLUMNS})
SELECT hour, worker_id, model_id, method, measured_j, estimated_j, busy_j, idle_j, busy_output_tokens, device_s,
       covered_s, measured_j / 3.6e6 * usd_per_kwh, num_intervals, num_reset, num_wrap, num_gap, num_implausible,
       num_rapl_ambiguous, jpt_busy_j, output_tokens
FROM rated
"""

# Per key: a share's tokens are on its window's token carrier only (counted once); busy_j sums the
# measured energy of every device's share. Tokens made in a window not measured on every device count in
# output_tokens only, so measured_output_tokens / output_tokens is the key's coverage, and J per output
# token is jpt_busy_j (the energy of the measured windows) / measured_output_tokens.
REFRESH_KEY_ENERGY_HOURLY = _PIECES.format(table="energy_attribution", hours="SELECT hour FROM dirty_now") + """
, agg AS (
    SELECT p.hour, p.worker_id, p.model_id, r.pool, r.api_key_id, p.method,
           sum(p.energy_j * p.frac) FILTER (p.method <> 'estimated') AS busy_j,
           sum(p.energy_j * p.frac) FILTER (p.method = 'estimated') AS estimated_j,
           sum(p.energy_j * p.frac) FILTER (p.is_window_measured) AS jpt_busy_j,
           sum(p.output_tokens * p.frac) AS output_tokens,
           coalesce(sum(p.output_tokens * p.frac) FILTER (p.is_window_measured), 0) AS measured_output_tokens
    FROM pieces p LEFT JOIN requests r USING (request_id)
    WHERE p.request_id IS NOT NULL
    GROUP BY ALL
)""" + _RATED + """
INSERT INTO key_energy_hourly (hour, worker_id, model_id, pool, api_key_id, busy_j, estimated_j, output_tokens,
                               energy_usd, method, measured_output_tokens, jpt_busy_j)
SELECT hour, worker_id, model_id, pool, api_key_id, busy_j, estimated_j, output_tokens, busy_j / 3.6e6 * usd_per_kwh,
       method, measured_output_tokens, jpt_busy_j
FROM rated
"""

# Month-to-date measured joules per API key (KeyEnergyQuery; docs/accounting.md, "Tables"): the busy_j the
# key rollups will hold after the next refresh, without waiting for it or writing anything. A day with no
# dirty hour is read from key_energy_daily (a few rows per key); in the days that have one, an hour whose
# rollup is current from key_energy_hourly, and an hour still in rollup_dirty (its raw rows changed since
# the last refresh) from the raw shares by the refresh's own rule. Dirty hours older than the raw cutoff
# keep their joules (they are only priced again), so they are read from the rollups like current ones.
# $1, $2: the month's [start, end); $3, $4: the [lo, hi) midnights of the days with a dirty hour (empty:
# none); $5: the raw cutoff (hours from it on are recomputed from raw rows).
KEY_ENERGY_OF_CURRENT_HOURS = """
SELECT api_key_id, sum(busy_j) FROM (
    SELECT api_key_id, busy_j FROM key_energy_daily
    WHERE day >= $1::DATE AND day < $2::DATE AND NOT (day >= $3::DATE AND day < $4::DATE)
    UNION ALL
    SELECT api_key_id, busy_j FROM key_energy_hourly
    WHERE hour >= $3 AND hour < $4 AND hour NOT IN (SELECT hour FROM rollup_dirty WHERE hour >= $5)
) WHERE api_key_id IS NOT NULL AND busy_j IS NOT NULL
GROUP BY api_key_id
"""
# $1, $2: the [lo, hi) span of the dirty hours wanted (every dirty hour in it is wanted); $3: no request
# that finished before it can own a share in them. The inner join leaves out a share whose usage record
# has not arrived: its energy belongs to no key until it does (its hours are marked dirty then).
KEY_ENERGY_OF_DIRTY_HOURS = _PIECES.format(
    table="energy_attribution", hours="SELECT hour FROM rollup_dirty WHERE hour >= $1 AND hour < $2") + """
SELECT r.api_key_id, sum(p.energy_j * p.frac) FROM pieces p JOIN requests r USING (request_id)
WHERE p.request_id IS NOT NULL AND p.energy_j IS NOT NULL AND p.method <> 'estimated'
  AND r.api_key_id IS NOT NULL AND r.ts >= $3
GROUP BY r.api_key_id
"""

REFRESH_USAGE_HOURLY = """
INSERT INTO usage_hourly
SELECT date_trunc('hour', ts) AS hour, model, pool, nullif(coalesce(nullif(worker_id, ''), member), '') AS worker_id,
       api_key_id,
       status, count(*), sum(prompt_tokens), sum(cached_tokens), sum(output_tokens)
FROM requests WHERE ts >= $1 AND ts < $2 AND date_trunc('hour', ts) IN (SELECT hour FROM dirty_now)
GROUP BY ALL
"""

REFRESH_DAILY = {
    "energy_daily": f"""
        INSERT INTO energy_daily (day, worker_id, model_id, method, {_ENERGY_COLUMNS})
        SELECT hour::DATE AS day, worker_id, model_id, method, sum(measured_j), sum(estimated_j), sum(busy_j),
               sum(idle_j), sum(busy_output_tokens), sum(device_s), sum(covered_s), sum(energy_usd),
               sum(num_intervals), sum(num_reset), sum(num_wrap), sum(num_gap), sum(num_implausible),
               sum(num_rapl_ambiguous), sum(jpt_busy_j), sum(output_tokens)
        FROM energy_hourly WHERE hour::DATE IN (SELECT day FROM dirty_days) GROUP BY ALL""",
    "key_energy_daily": """
        INSERT INTO key_energy_daily (day, worker_id, model_id, pool, api_key_id, busy_j, estimated_j, output_tokens,
                                      energy_usd, method, measured_output_tokens, jpt_busy_j)
        SELECT hour::DATE AS day, worker_id, model_id, pool, api_key_id, sum(busy_j), sum(estimated_j),
               sum(output_tokens), sum(energy_usd), method, sum(measured_output_tokens), sum(jpt_busy_j)
        FROM key_energy_hourly WHERE hour::DATE IN (SELECT day FROM dirty_days) GROUP BY ALL""",
    "usage_daily": """
        INSERT INTO usage_daily
        SELECT hour::DATE AS day, model, pool, worker_id, api_key_id, status, sum(num_requests),
               sum(prompt_tokens), sum(cached_tokens), sum(output_tokens)
        FROM usage_hourly WHERE hour::DATE IN (SELECT day FROM dirty_days) GROUP BY ALL""",
}

# Hours older than the raw-data retention (``dirty_old``): their raw rows may be gone, but the hourly
# rollups keep the joules, so a rate entered later (a dated tariff) prices them again in place.
_RATE_OF_OLD_HOURS = ("(SELECT d.hour, t.usd_per_kwh FROM dirty_old d "
                      "ASOF LEFT JOIN tariff t ON d.hour >= t.effective_from)")
REPRICE_HOURLY = (
    f"UPDATE energy_hourly SET energy_usd = measured_j / 3.6e6 * r.usd_per_kwh FROM {_RATE_OF_OLD_HOURS} r "
    "WHERE energy_hourly.hour = r.hour",
    f"UPDATE key_energy_hourly SET energy_usd = busy_j / 3.6e6 * r.usd_per_kwh FROM {_RATE_OF_OLD_HOURS} r "
    "WHERE key_energy_hourly.hour = r.hour",
)

ROLLUP_TABLES = ("energy_hourly", "energy_daily", "key_energy_hourly", "key_energy_daily", "usage_hourly",
                 "usage_daily")
