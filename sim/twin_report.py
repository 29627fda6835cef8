"""The digital twin's result (`TwinResult`) and its report: the text `hicache twin` prints, the
per-request table, and the files it writes (summary.json and the replay's records)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from hicache.results import RequestRecord
from hicache.sim.calibrate import Calibration
from hicache.sim.twin_clients import Clients
from hicache.sim.twin_compare import request_rows
from hicache.sim.twin_intervals import DRAWS, LEVEL
from hicache.sim.twin_recording import TIERS, Recording
from hicache.sim.twin_tiers import TierDiff, reason_counts


@attrs.frozen(slots=True)
class TwinResult:
    recording: Recording
    calibration: Calibration
    baseline: str
    measured: dict[str, Any]
    predicted: dict[str, Any]
    errors: dict[str, float | None]
    records: dict[str, RequestRecord]
    tiers_equal: int
    sequential: bool = False  # replayed one request at a time (`one_client`)
    overrides: tuple[str, ...] = ()
    what_if: dict[str, Any] | None = None
    what_if_baseline: str | None = None
    what_if_records: dict[str, RequestRecord] | None = None
    # The what-if's change of each metric, its interval by bootstrap over sessions
    # (`twin_intervals.py`), and how many sessions it was drawn from.
    what_if_intervals: dict[str, tuple[float, float] | None] | None = None
    what_if_sessions: int = 0
    what_if_replays: int = 1  # replay pairs the interval was drawn over (the plain one, jittered ones)
    clients: Clients | None = None  # what the recording says of its clients
    replayed_clients: int = 0  # the sessions open at once in the replay (0: no limit)
    tier_diffs: tuple[TierDiff, ...] = ()  # the requests whose tiers differ, with the reason


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def report(res: TwinResult) -> str:
    """The table the command prints."""
    c = res.calibration
    n = len(res.recording.requests)
    lines = [
        f"recording        {res.recording.path} ({n} requests, blocks of {res.recording.block_size} tokens)",
        f"replayed as      {res.baseline}"
        + (", one request at a time (as the recorded client sent them)" if res.sequential else ""),
        f"calibration      ({c.source}) prefill {c.prefill_tokens_per_s:,.0f} tok/s, attention "
        f"{c.prefill_attention_s:.3g} s/pair, first-token overhead {c.first_token_overhead_s * 1e3:.2f} ms, "
        f"decode step {c.decode_step_s * 1e3:.2f} ms"
        f" + {c.decode_step_per_context_token_s * 1e6:.3f} us/ctx token",
        f"                 P->D {_rate(c.transfer_seconds_per_token)}, "
        f"L2 restore {_rate(c.l2_seconds_per_token)}, "
        f"L3 restore {_rate(c.l3_seconds_per_token)}; "
        f"residuals rms TTFT {c.ttft_residual_rms_s * 1e3:.2f} ms ({c.ttft_rows} req), "
        f"TPOT {c.tpot_residual_rms_s * 1e3:.2f} ms ({c.tpot_rows} req); outliers left out: "
        f"{c.ttft_trimmed} TTFT, {c.tpot_trimmed} TPOT",
        (
            f"                 fitted to the node's phases on {c.phased_rows} requests: their waits "
            f"(mean {c.queued_mean_s * 1e3:.1f} ms) off TTFT, prefill and P->D to their own times"
            if c.phased_rows
            else "                 fitted to end-to-end TTFT (the recording has no phases)"
        ),
        *(
            [
                f"warning          {', '.join(c.fallbacks)} from the node's own settings: the recording "
                "cannot identify them (TTFT does not grow with the tokens prefill computed)"
            ]
            if c.fallbacks
            else []
        ),
        *_clients_lines(res),
        f"tiers equal      {res.tiers_equal}/{n} requests (L1, L2, L3 restored tokens as measured)"
        + _reasons(res),
        "",
    ]
    head = f"{'metric':<16}{'measured':>12}{'predicted':>12}{'error':>10}"
    if res.what_if is not None:
        head += f"{'what-if':>12}{'change':>10}  {f'{LEVEL:.0%} interval':<20}"
    lines.append(head)
    rows = [
        ("hit rate", "hit_rate", lambda x: f"{x:.1%}", "hit_rate_pp"),
        ("TTFT mean s", "ttft_mean_s", _s, "ttft_mean"),
        ("TTFT p90 s", "ttft_p90_s", _s, "ttft_p90"),
        ("TPOT mean s", "tpot_mean_s", _s, "tpot_mean"),
    ]
    for label, key, fmt, err in rows:
        e = res.errors[err]
        shown = "-" if e is None else (f"{e:+.1f}pp" if err == "hit_rate_pp" else _pct(e))
        line = f"{label:<16}{fmt(res.measured[key]):>12}{fmt(res.predicted[key]):>12}{shown:>10}"
        if res.what_if is not None:
            w, p = res.what_if[key], res.predicted[key]
            if key == "hit_rate":
                change = f"{100 * (w - p):+.1f}pp"
            else:
                change = "-" if w is None or not p else _pct((w - p) / p)
            line += f"{fmt(w):>12}{change:>10}  {_interval(res, key):<20}"
        lines.append(line)
    per_request_error = res.errors.get("ttft_per_request")
    if per_request_error is not None:
        lines.append(f"{'TTFT per request':<16}{'':>12}{'':>12}{per_request_error:>9.1%}  (mean |error|)")
    for i, tier in enumerate(TIERS):
        line = (
            f"{'cached ' + tier.upper():<16}{res.measured['cached_tokens'][tier]:>12}"
            f"{res.predicted['cached_tokens'][tier]:>12}{'':>10}"
        )
        if res.what_if is not None:
            line += f"{res.what_if['cached_tokens'][tier]:>12}"
        lines.append(line)
        del i
    if res.what_if is not None:
        lines.append(
            f"(what-if: {' '.join(res.overrides)}, replayed as {res.what_if_baseline}; change is against the "
            "predicted baseline, whose error above bounds how far to trust it)"
        )
        lines.append(
            f"(interval: the change over {DRAWS} bootstrap draws of the {res.what_if_sessions} sessions "
            f"across {res.what_if_replays} replay pairs, {res.what_if_replays - 1} with each request's "
            "prefill time scaled by a draw of the in-sample per-request TTFT error: the spread over traffic "
            "like the recorded and over the node's timing; the cost model's bias is the error column)"
        )
    return "\n".join([*lines, "", *per_request(res), *([""] if res.tier_diffs else []), *tier_lines(res)])


PER_REQUEST_ROWS = 40  # printed in full up to this many requests; beyond, only those that differ


def per_request(res: TwinResult) -> list[str]:
    """Measured against predicted, request by request (all of a short recording, else the
    requests whose tiers differ, up to `PER_REQUEST_ROWS`)."""
    rows = list(request_rows(res.recording, res.records, None))
    short = len(rows) <= PER_REQUEST_ROWS

    def tiers(row: dict[str, Any], who: str) -> tuple[Any, ...]:
        return tuple(row[f"{who}_{t}"] for t in TIERS)

    shown = [r for r in rows if short or tiers(r, "measured") != tiers(r, "predicted")]
    if not shown:
        return ["every request's L1/L2/L3 tokens as measured (per request: requests.csv with --out)"]
    what = "per request" if short else f"requests whose tiers differ (first {PER_REQUEST_ROWS})"
    out = [
        f"{what}: L1/L2/L3 tokens and TTFT s, measured -> predicted",
        f"{'id':<10}{'session':>8}{'prompt':>8}  {'measured':>16}  {'predicted':>16}"
        f"{'TTFT':>9}{'->':>3}{'TTFT':>9}",
    ]
    for r in shown[:PER_REQUEST_ROWS]:
        m, p = tiers(r, "measured"), tiers(r, "predicted")
        mark = "" if m == p else "  *"
        out.append(
            f"{r['id']:<10}{r['session']:>8}{r['input_length']:>8}  {'/'.join(map(str, m)):>16}  "
            f"{'/'.join(map(str, p)):>16}{_cell(r['measured_ttft_s']):>9}{'':>3}"
            f"{_cell(r['predicted_ttft_s']):>9}{mark}"
        )
    return out


def _clients_lines(res: TwinResult) -> list[str]:
    c = res.clients
    if c is None:
        return []
    think = "-" if c.think_mean_s is None else f"{c.think_mean_s:.3f} s mean, {c.think_max_s:.3f} s max"
    source = "recorded arrivals" if c.from_arrivals else "arrival gaps less measured times"
    limit = f"at most {res.replayed_clients} sessions open at once" if res.replayed_clients else "no limit"
    return [
        f"clients          {c.count or 1} inferred ({c.peak_sessions} sessions open at once at most, "
        f"{c.peak_in_flight} requests in flight); replayed with {limit}",
        f"think time       {think} (from {source})",
    ]


def _reasons(res: TwinResult) -> str:
    counts = reason_counts(list(res.tier_diffs))
    return "" if not counts else "; differ: " + ", ".join(f"{v} {k}" for k, v in counts.items())


def tier_lines(res: TwinResult) -> list[str]:
    """The requests whose tiers differ, each with its reason (`twin_tiers.py`)."""
    if not res.tier_diffs:
        return []
    out = ["requests whose tiers differ: measured -> predicted L1/L2/L3, reason"]
    for d in res.tier_diffs[:PER_REQUEST_ROWS]:
        got = "-" if d.predicted is None else "/".join(map(str, d.predicted))
        out.append(
            f"{d.id:<10}{d.session:>8}  {'/'.join(map(str, d.measured)):>14} -> {got:<14} {d.reason}"
            + (f" ({d.detail})" if d.detail else "")
        )
    return out


def _interval(res: TwinResult, key: str) -> str:
    iv = (res.what_if_intervals or {}).get(key)
    if iv is None:
        return "-"
    if key == "hit_rate":
        return f"[{iv[0]:+.1f}, {iv[1]:+.1f}]pp"
    return f"[{iv[0]:+.1%}, {iv[1]:+.1%}]"


def _cell(x: float | str) -> str:
    return "-" if x == "" else f"{x:.3f}"


def _rate(seconds_per_token: float | None) -> str:
    return "not fitted" if not seconds_per_token else f"{1 / seconds_per_token:,.0f} tok/s"


def summary_doc(res: TwinResult, sc_doc: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """summary.json: the overall figures, flat, then the calibration and the what-if."""
    out: dict[str, Any] = {
        "recording": str(res.recording.path),
        "baseline": res.baseline,
        "one_request_at_a_time": res.sequential,
    }
    for key in ("hit_rate", "ttft_mean_s", "ttft_p90_s", "tpot_mean_s"):
        out[f"predicted_{key}"] = res.predicted[key]
        out[f"measured_{key}"] = res.measured[key]
    out["predicted_cached_tokens"] = res.predicted["cached_tokens"]
    out["measured_cached_tokens"] = res.measured["cached_tokens"]
    out["requests"] = len(res.recording.requests)
    out["compared_requests"] = res.predicted["requests"]
    out["tiers_equal"] = res.tiers_equal
    out["tier_differences"] = [d.doc() for d in res.tier_diffs]
    out["tier_difference_reasons"] = reason_counts(list(res.tier_diffs))
    if res.clients is not None:
        out["clients"] = {**res.clients.doc(), "replayed_clients": res.replayed_clients}
    out["errors"] = res.errors
    out["calibration"] = res.calibration.to_dict()
    if res.what_if is not None:
        out["what_if"] = {
            "overrides": list(res.overrides),
            "baseline": res.what_if_baseline,
            **{f"predicted_{k}": v for k, v in res.what_if.items() if k != "requests"},
            # hit rate in points, times relative; the central LEVEL of bootstrap draws over sessions
            # and jittered replays (`twin_intervals`)
            "change_interval": {k: list(v) if v else None for k, v in (res.what_if_intervals or {}).items()},
            "interval_level": LEVEL,
            "interval_sessions": res.what_if_sessions,
            "interval_replays": res.what_if_replays,
        }
    if sc_doc is not None:
        out["scenario"] = dict(sc_doc)
    return out


def write_outputs(out: Path, res: TwinResult) -> list[Path]:
    """summary.json and requests.csv under `out`."""
    import csv

    from hicache.results import write_summary_json
    from hicache.sim.runner import check_out

    check_out(out)  # an OutputError (exit 2) naming --out when it cannot be written
    paths = [out / "summary.json", out / "requests.csv"]
    write_summary_json(paths[0], summary_doc(res))
    rows = list(request_rows(res.recording, res.records, res.what_if_records))
    with paths[1].open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return paths
