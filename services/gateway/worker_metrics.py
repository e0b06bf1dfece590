"""One /metrics answer for a gateway that runs as several worker processes (``llmgw gateway --workers N``). Pure.

A scrape lands on whichever worker the kernel hands the connection to. Each worker's counters are its
own, so a worker that answered with only its own text would pass one worker's traffic off as the whole
gateway's. Instead the worker that is scraped asks its siblings over the bus
(:func:`proto.subjects.gateway_metrics`) for their texts and answers with every worker's samples, each
with a ``worker`` label (``w0`` … ``wN-1``): Prometheus sums them with ``sum without (worker) (…)``.

Two gauges say how complete the answer is: ``llmgw_gateway_workers`` (how many the gateway runs) and
``llmgw_gateway_workers_reporting`` (how many texts this answer holds; fewer while a worker restarts
or the bus is down). docs/reliability.md, "Gateway workers".
"""

from __future__ import annotations

from collections.abc import Mapping

WORKER_LABEL = "worker"


def with_label(sample: str, name: str, value: str) -> str:
    """One exposition sample line with the label ``name="value"`` added first."""
    label = f'{name}="{value}"'
    brace = sample.find("{")
    space = sample.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        rest = sample[brace + 1:]
        return f"{sample[:brace]}{{{label}{'' if rest.startswith('}') else ','}{rest}"
    if space == -1:
        return sample  # not a sample line; left alone
    return f"{sample[:space]}{{{label}}}{sample[space:]}"


def _families(text: str) -> list[tuple[str, list[str], list[str]]]:
    """(family name, its # lines, its samples) in the order the text has them."""
    families: list[tuple[str, list[str], list[str]]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(maxsplit=3)
            name = parts[2] if len(parts) > 2 else ""
            if not families or families[-1][0] != name or families[-1][2]:
                families.append((name, [], []))
            families[-1][1].append(line)
        else:
            if not families:
                families.append(("", [], []))
            families[-1][2].append(line)
    return families


def merge(texts: Mapping[str, str], num_workers: int) -> str:
    """The texts of several workers (keyed by worker label) as one exposition: each family's comment lines
    once, then its samples from every worker, each labelled with its worker; families in first-seen order
    (the format wants a family's samples together)."""
    order: list[str] = []
    comments: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for worker in sorted(texts):
        for name, notes, lines in _families(texts[worker]):
            if name not in comments:
                order.append(name)
                comments[name] = notes
                samples[name] = []
            samples[name].extend(with_label(line, WORKER_LABEL, worker) for line in lines)
    out = ["# HELP llmgw_gateway_workers Worker processes this gateway runs (llmgw gateway --workers).",
           "# TYPE llmgw_gateway_workers gauge", f"llmgw_gateway_workers {num_workers}",
           "# HELP llmgw_gateway_workers_reporting Workers whose samples this answer holds (fewer while one "
           "restarts or the bus is down); each sample carries a worker label.",
           "# TYPE llmgw_gateway_workers_reporting gauge", f"llmgw_gateway_workers_reporting {len(texts)}"]
    for name in order:
        out.extend(comments[name])
        out.extend(samples[name])
    return "\n".join(out) + "\n"
