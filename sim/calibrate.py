"""Fitting the simulator's cost model to what a serving node measured, request by request.

A recorded trace (`hicache serve --record-trace`) gives, per request, its prompt, the tokens
each tier restored, the tokens prefill found cached, and the measured TTFT and TPOT. The node's
hardware is whatever it ran on (a CPU, a GPU no preset names), so instead of a preset the costs
come from the recording itself, by least squares with non-negative coefficients:

- a decode step: `tpot = a + b * context`, context being the prompt plus half the output (the
  mean context over the request's steps); where the recording shows which requests decoded at
  once (each request's first token and end), a request's TPOT also paid for the others in its
  batch, which the simulator charges per step as `(batch - 1) / prefill_rate + b * (the batch's
  contexts summed)`: that part comes off, and `context` is the batch's, so a replay with batches
  of its own does not charge them twice;
- the first token, which prefill computes: `ttft = c + u / prefill_rate + attention * pairs
  + sx * x + s2 * l2_tokens + s3 * l3_tokens`, where u are the prompt tokens prefill computed
  (prompt minus what prefill, or else the decode node, had cached), `pairs` the (new, earlier)
  token pairs their attention covers, x the tokens whose KV crossed P->D (prompt minus what the
  decode node had cached), and sx, s2, s3 the seconds per token transferred, restored from host
  memory and restored from storage. The transfer term is what a decode-side hit saves: with a
  prefill cache that holds every earlier prompt, u is each turn's new tokens while x grows with
  what the decode node lost, so the two columns part. A term whose column carries no signal (no
  request restored from L3; x equal to u, as in a recording without prefill's own count) is
  left out and its rate stays the node's own setting.

TTFT holds the time a request queued (on the decode node, then behind prefill's other work),
which the replay simulates by itself: fitted into the costs, it would count twice and grow with
the load. So where the recording carries the node's own phases (`phases` on a line: the waits,
prefill's compute, the transfer), each request's waits come off its TTFT, prefill's rate and
attention cost are fitted to the seconds its own forwards took, and the transfer's rate to the
transfer's seconds; the first token's overhead and the restore rates are fitted to what is left.
Fitted to its own time, a transfer is told from compute even where the two grow together.

Both fits are robust by trimming (`robust_nnls`): a request more than 5 robust standard
deviations from the fit (1.4826 x the median absolute deviation) is left out and the fit redone,
at most a fifth of the requests. So one request that waited 147 s for a reason the cost model
does not know (a stall, a retry) cannot pull the rates fitted to the others, while ordinary
noise stays in. How many requests were left out is reported.

A term the recording cannot identify falls back to a prior: when TTFT does not grow with the
tokens prefill computed (too few requests, or prompts of one length), the prefill rate and the
attention cost are taken from `prior` (the twin passes the node's own settings), the other terms
are fitted to what is left, and `fallbacks` names what came from the prior. Only without a prior
is that an error.

The fit is reported with its residuals, so a reader sees how well a linear model explains the
node; the twin (`hicache.sim.twin`) turns it into a scenario's hardware and model figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np
import scipy.optimize

MIN_ROWS_PER_TERM = 3  # a term is fitted only when at least this many requests exercise it
TRIM_SDS = 5.0  # a request further than this many robust SDs from the fit is left out of it
MAD_TO_SD = 1.4826  # the median absolute deviation of normal noise times this is its SD
MIN_SCALE_S = 1e-6  # below a microsecond, timings carry no signal (and exact data has no spread)
MAX_TRIMMED = 0.2  # at most this share of the requests is ever left out
ROBUST_ROUNDS = 20


@attrs.frozen(slots=True)
class Sample:
    """What one request measured, as the fit reads it."""

    prompt: int
    output: int
    computed: int  # prompt tokens prefill computed
    l2: int  # tokens restored from host memory on the decode node
    l3: int  # tokens restored from storage
    ttft_s: float | None
    tpot_s: float | None
    transferred: int | None = None  # prompt tokens whose KV crossed P->D (None: not recorded)
    # The node's own account of the time to the prompt's KV (None: not recorded): seconds it
    # waited (decode node, then prefill's queue), prefill's own forwards, the P->D transfer.
    queued_s: float | None = None
    compute_s: float | None = None
    transfer_s: float | None = None
    # Requests decoding at once with it, itself included, and their contexts summed: each the
    # mean over its decode (None: not known; then it decoded alone, its own context).
    batch: float | None = None
    batch_context: float | None = None


@attrs.frozen(slots=True)
class Calibration:
    """The fitted costs; a rate left as None was not fitted (its term had no signal)."""

    prefill_tokens_per_s: float
    prefill_attention_s: float  # per (new token, earlier token) pair
    first_token_overhead_s: float  # c: latency of the first token beyond prefill's compute
    decode_step_s: float  # a
    decode_step_per_context_token_s: float  # b
    l2_seconds_per_token: float | None = None
    l3_seconds_per_token: float | None = None
    transfer_seconds_per_token: float | None = None  # sx: per token sent P->D
    ttft_rows: int = 0
    tpot_rows: int = 0
    ttft_residual_rms_s: float = 0.0
    tpot_residual_rms_s: float = 0.0
    ttft_residual_max_s: float = 0.0
    tpot_residual_max_s: float = 0.0
    source: str = "fit"  # "fit": from the recording; "header": the node's own settings
    ttft_trimmed: int = 0  # requests left out of the TTFT fit as outliers
    tpot_trimmed: int = 0
    fallbacks: tuple[str, ...] = ()  # rates taken from the prior, since the recording had no signal
    # Requests whose recorded phases the fit used: their waits taken off TTFT, prefill's rate
    # fitted to its compute time and the transfer's to its transfer time (0: TTFT alone).
    phased_rows: int = 0
    queued_mean_s: float = 0.0  # the mean wait taken off those requests' TTFT

    def to_dict(self) -> dict[str, float | int | str | None]:
        return attrs.asdict(self)


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (SciPy's Lawson-Hanson active-set solver; columns
    scaled to unit norm for conditioning). An active-set method lets a dropped column back in
    when the others have moved, so two columns that grow together (attention pairs and
    transferred tokens, say) do not lose the one the data also needs."""
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    coef, _ = scipy.optimize.nnls(a / norms, y)
    return coef / norms


def robust_nnls(a: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`nnls` with gross outliers trimmed: fit, leave out the rows whose residual is over
    `TRIM_SDS` robust standard deviations (1.4826 x the median absolute deviation of the kept
    rows' residuals, at least `MIN_SCALE_S`), fit the rest again, until the kept rows stop
    changing; never more than `MAX_TRIMMED` of the rows. Returns the coefficients and a mask of
    the rows kept. Ordinary noise (a tick's rounding, normal jitter) lies well within the bound,
    so only requests no linear cost explains are left out."""
    n = len(y)
    keep = np.ones(n, dtype=bool)
    coef = nnls(a, y)
    for _ in range(ROBUST_ROUNDS):
        r = np.abs(a @ coef - y)
        kept = r[keep]
        scale = max(MAD_TO_SD * float(np.median(np.abs(kept - np.median(kept)))), MIN_SCALE_S)
        new = r <= TRIM_SDS * scale
        most = int(n * MAX_TRIMMED)
        if n - int(new.sum()) > most:  # trim only the worst `most` rows
            new = np.ones(n, dtype=bool)
            if most:
                new[np.argsort(r)[n - most :]] = False
        if (new == keep).all():
            break
        keep = new
        coef = nnls(a[keep], y[keep])
    return coef, keep


def _pairs(computed: int, cached: int) -> float:
    """(new, earlier) token pairs the attention of `computed` tokens after `cached` ones covers:
    the cost model's own count (`NodeCosts.prefill_seconds`)."""
    return computed * cached + computed * (computed - 1) / 2


def _residuals(a: np.ndarray, coef: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    if not len(y):
        return 0.0, 0.0
    r = a @ coef - y
    return float(math.sqrt(float(np.mean(r * r)))), float(np.max(np.abs(r)))


def fit(samples: Sequence[Sample], prior: Calibration | None = None) -> Calibration:
    """The costs that explain `samples` best (ValueError when too few requests measured both a
    first token and a later one to fit anything, or when prefill's rate cannot be fitted and
    there is no `prior` to take it from)."""
    steps = [s for s in samples if s.tpot_s is not None and s.output > 1]
    firsts = [s for s in samples if s.ttft_s is not None]
    if len(steps) < 2 or len(firsts) < 2:
        raise ValueError(
            f"calibration needs at least 2 requests with a TTFT and 2 with a TPOT (output > 1 token); "
            f"the recording has {len(firsts)} and {len(steps)}"
        )
    # The first token: prefill's (it computes the first output token), then the transfer's tail.
    # Where the node recorded its phases, the waits come off TTFT (the replay queues on its own)
    # and prefill's and the transfer's rates are fitted to their own measured times.
    phased = np.array([s.queued_s is not None for s in firsts], dtype=bool)
    queued = np.array([s.queued_s or 0.0 for s in firsts], dtype=np.float64)
    y = np.array([s.ttft_s for s in firsts], dtype=np.float64) - queued
    columns = {
        "overhead": [1.0] * len(firsts),
        "computed": [float(s.computed) for s in firsts],
        "pairs": [_pairs(s.computed, s.prompt - s.computed) for s in firsts],
        "l2": [float(s.l2) for s in firsts],
        "l3": [float(s.l3) for s in firsts],
        "transferred": [float(s.transferred or 0) for s in firsts],
    }
    used = [k for k, v in columns.items() if k == "overhead" or sum(x > 0 for x in v) >= MIN_ROWS_PER_TERM]
    fixed = _phase_rates(firsts, used)
    # Transfers that always equal the computed tokens cannot be told from compute by TTFT alone.
    parted = sum(s.transferred is not None and s.transferred != s.computed for s in firsts)
    if "transferred" in used and "transferred" not in fixed and parted < MIN_ROWS_PER_TERM:
        used.remove("transferred")
    fallbacks: tuple[str, ...] = ()
    if "computed" not in fixed:
        coef, _ = _fit_first_token(columns, used, y)
        if coef.get("computed", 0.0) <= 0:
            if prior is None:
                raise ValueError(
                    "calibration: TTFT does not grow with the prompt tokens prefill computed, so no "
                    "prefill rate can be fitted (vary the prompt lengths, or record more requests)"
                )
            # Prefill's own terms from the prior; the rest fitted to what they leave unexplained.
            fixed |= {"computed": 1.0 / prior.prefill_tokens_per_s, "pairs": prior.prefill_attention_s}
            fallbacks = ("prefill_tokens_per_s", "prefill_attention_s")
    if fixed:
        known = sum(np.asarray(columns[k], dtype=np.float64) * v for k, v in fixed.items())
        rest = [k for k in used if k not in fixed]
        coef, tt_kept = _fit_first_token(columns, rest, y - known)
        coef |= fixed
        used = [*rest, *fixed]
    else:
        coef, tt_kept = _fit_first_token(columns, used, y)
    # The decode step, as the simulator charges it: a + (batch - 1) / prefill_rate + b * the
    # contexts of the batch summed. Where the recording shows which requests decoded at once
    # (`batch`, `batch_context`: their means over the request's decode), a request's TPOT holds
    # the others' cost, which the replay charges again for its own batches: it comes off first.
    per_token = coef["computed"]
    ctx = np.array([s.batch_context or (s.prompt + s.output / 2) for s in steps], dtype=np.float64)
    others = np.array([max(0.0, (s.batch or 1.0) - 1.0) for s in steps], dtype=np.float64)
    tpot = np.array([s.tpot_s for s in steps], dtype=np.float64) - others * per_token
    a_tp = np.column_stack([np.ones_like(ctx), ctx])
    if np.ptp(ctx) > 0:
        step, tp_kept = robust_nnls(a_tp, tpot)
    else:
        step, tp_kept = np.array([max(0.0, float(np.median(tpot))), 0.0]), np.ones(len(tpot), dtype=bool)
    a, b = float(step[0]), float(step[1])
    tp_rms, tp_max = _residuals(a_tp, step, tpot)
    a_tt = np.column_stack([columns[k] for k in used])
    tt_rms, tt_max = _residuals(a_tt, np.array([coef[k] for k in used]), y)
    return Calibration(
        prefill_tokens_per_s=1.0 / coef["computed"],
        prefill_attention_s=coef.get("pairs", 0.0),
        first_token_overhead_s=coef["overhead"],
        decode_step_s=a,
        decode_step_per_context_token_s=b,
        l2_seconds_per_token=coef["l2"] if "l2" in coef and coef["l2"] > 0 else None,
        l3_seconds_per_token=coef["l3"] if "l3" in coef and coef["l3"] > 0 else None,
        transfer_seconds_per_token=coef.get("transferred") or None,
        ttft_rows=len(firsts),
        tpot_rows=len(steps),
        ttft_residual_rms_s=tt_rms,
        tpot_residual_rms_s=tp_rms,
        ttft_residual_max_s=tt_max,
        tpot_residual_max_s=tp_max,
        ttft_trimmed=int(np.sum(~tt_kept)),
        tpot_trimmed=int(np.sum(~tp_kept)),
        fallbacks=fallbacks,
        phased_rows=int(phased.sum()),
        queued_mean_s=float(queued[phased].mean()) if phased.any() else 0.0,
    )


def _phase_rates(firsts: Sequence[Sample], used: Sequence[str]) -> dict[str, float]:
    """Prefill's and the transfer's rates fitted to the times the node recorded for them (robust,
    with an intercept for each forward's or message's fixed cost, which the first token's
    overhead takes up): prefill's compute `computed / rate + attention * pairs`, the transfer
    `sx * transferred`. A term is fitted only when `MIN_ROWS_PER_TERM` requests recorded it
    and its column varies; {} when the recording has no phases."""
    out: dict[str, float] = {}
    rows = [s for s in firsts if s.compute_s is not None]
    computed = np.array([s.computed for s in rows], dtype=np.float64)
    if len(rows) >= MIN_ROWS_PER_TERM and np.ptp(computed) > 0:
        pairs = np.array([_pairs(s.computed, s.prompt - s.computed) for s in rows], dtype=np.float64)
        names = ["computed", *(["pairs"] if "pairs" in used and np.ptp(pairs) > 0 else [])]
        a = np.column_stack([np.ones_like(computed), computed, *([pairs] if "pairs" in names else [])])
        coef, _ = robust_nnls(a, np.array([s.compute_s for s in rows], dtype=np.float64))
        if coef[1] > 0:
            out |= {"computed": float(coef[1]), "pairs": float(coef[2]) if "pairs" in names else 0.0}
    if "transferred" in used:
        rows = [s for s in firsts if s.transfer_s is not None and s.transferred is not None]
        x = np.array([s.transferred for s in rows], dtype=np.float64)
        if len(rows) >= MIN_ROWS_PER_TERM and np.ptp(x) > 0:
            a = np.column_stack([np.ones_like(x), x])
            coef, _ = robust_nnls(a, np.array([s.transfer_s for s in rows], dtype=np.float64))
            out["transferred"] = float(coef[1])
    return out


def _fit_first_token(
    columns: dict[str, list[float]], used: Sequence[str], y: np.ndarray
) -> tuple[dict[str, float], np.ndarray]:
    """The first token's terms `used`, fitted robustly to `y`; and which rows the fit kept."""
    if not used:
        return {}, np.ones(len(y), dtype=bool)
    a = np.column_stack([columns[k] for k in used])
    coef, kept = robust_nnls(a, y)
    return {k: float(v) for k, v in zip(used, coef, strict=True)}, kept
