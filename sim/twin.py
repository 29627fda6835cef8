"""The digital twin: a trace recorded by `hicache serve --record-trace` replayed in the simulator,
on the recorded node's own configuration and on costs fitted to its own measurements, to see how
well the simulator predicts what the node did, and then what another configuration would do.

The recording's header becomes the scenario: the model's geometry (a custom model), page size,
L1 and L2 in tokens, every cache policy, storage, node counts and router. The node's hardware is
not a preset, so the costs are fitted from the requests' TTFT and TPOT, and from the node's
recorded phases where the lines carry them: waits off TTFT, prefill and the transfer fitted to
their own times (`hicache.sim.calibrate`), and turned into figures of a one-GPU node: FLOP/s and
active parameters give the prefill rate and its attention term, HBM bandwidth the decode step's
per-context cost, the step overhead the rest of a step, the host link and storage the restore
rates, the P->D link the fitted cost per token transferred (so a what-if that keeps more pages
on the decode node sees the transfers they save) and its latency the first token's fixed delay.
The prefill node's cache is the size the header records (`prefill_cache_bytes`; the runtime's
default, 512 MiB, when a header predates it).

Requests are replayed with their recorded block ids. A session's next prompt names, block by
block, what its previous answer left in the cache, so a request's output pages take the keys of
the following request of its session where that one extends its prompt (other output pages stay
private, as for any trace). Sessions replay closed-loop: a turn is sent once the previous one is
answered, after the client's own pause (recorded: the gap from its previous turn's end), with
at most as many sessions open at once as the recorded clients kept (`twin_clients.py`), behind
the front door the header records (`hicache serve`'s admission: requests wait there, not in the
decode node's core).
A recording whose ids are coarser than the node's pages is refused unless `approximate`.
Requests whose tiers the replay did not predict are listed with a reason (`twin_tiers.py`).

The twin is in parts: the recording read and checked (`twin_recording.py`), the scenario and
costs from its header and requests (`twin_scenario.py`), the replay (`twin_replay.py`), the
comparison of measured and predicted figures (`twin_compare.py`) and the report (`twin_report.py`);
here is the command that runs them, and every public name of the parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs

from hicache.sim.calibrate import Sample, fit
from hicache.sim.twin_clients import Clients, check_granularity, infer_clients, think_s
from hicache.sim.twin_compare import errors, overall, request_rows, tiers_equal, ttft_request_error
from hicache.sim.twin_intervals import change_intervals, jitters, service_scales, sessions_compared
from hicache.sim.twin_recording import PHASES, TIERS, WAITS, Recorded, Recording, TwinError, read_recording
from hicache.sim.twin_replay import one_client, replay, work_items
from hicache.sim.twin_report import TwinResult, per_request, report, summary_doc, write_outputs
from hicache.sim.twin_scenario import (
    CACHE_POLICY_KEYS,
    PREFILL_CACHE_BYTES,
    NodeFacts,
    header_costs,
    node_facts,
    samples,
    scenario,
    scenario_doc,
)
from hicache.sim.twin_tiers import TierDiff, reason_counts, tier_differences

# The twin's public names, wherever they are defined: callers name `twin` alone.
__all__ = [
    "CACHE_POLICY_KEYS",
    "Clients",
    "TierDiff",
    "check_granularity",
    "infer_clients",
    "reason_counts",
    "think_s",
    "tier_differences",
    "PHASES",
    "PREFILL_CACHE_BYTES",
    "TIERS",
    "WAITS",
    "NodeFacts",
    "Recorded",
    "Recording",
    "Sample",
    "TwinError",
    "TwinResult",
    "errors",
    "fit",
    "header_costs",
    "node_facts",
    "one_client",
    "overall",
    "per_request",
    "read_recording",
    "replay",
    "report",
    "request_rows",
    "samples",
    "scenario",
    "scenario_doc",
    "summary_doc",
    "tiers_equal",
    "ttft_request_error",
    "twin",
    "work_items",
    "write_outputs",
]


def twin(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    calibrate: bool = True,
    common: Sequence[str] = (),
    approximate: bool = False,
) -> TwinResult:
    """Replay the recording at `path` as recorded (the prediction of what the node did) and, with
    `overrides`, again with them applied (the what-if). `common` overrides apply to both (e.g.
    `workload.arrivals=open`: turns arrive when they were recorded instead of after the turn
    before). `approximate`: replay a recording coarser than the node's pages anyway."""
    rec = read_recording(path)
    facts = node_facts(rec)
    check_granularity(rec, facts.page_size, approximate=approximate)
    if calibrate:
        try:
            cal = fit(samples(rec), prior=header_costs(facts))
        except ValueError as exc:
            raise TwinError(f"{rec.path}: {exc}") from None
    else:
        cal = header_costs(facts)
    base_sc = scenario(rec, facts, cal, common)
    base = replay(rec, base_sc)
    sequential = one_client(rec, base_sc)
    measured = overall(rec, None)
    predicted = overall(rec, base)
    out = TwinResult(
        recording=rec,
        calibration=cal,
        baseline=base_sc.run.baselines[0],
        measured=measured,
        predicted=predicted,
        errors={**errors(measured, predicted), "ttft_per_request": ttft_request_error(rec, base)},
        records=base,
        tiers_equal=tiers_equal(rec, base),
        sequential=sequential,
        clients=infer_clients(rec),
        replayed_clients=base_sc.workload.clients,
        tier_diffs=tuple(tier_differences(rec, base)),
    )
    if not overrides:
        return out
    what_sc = scenario(rec, facts, cal, [*common, *overrides])
    what = replay(rec, what_sc)
    jittered = [
        (replay(rec, base_sc, scales), replay(rec, what_sc, scales))
        for scales in jitters(rec, service_scales(rec, base))
    ]
    return attrs.evolve(
        out,
        overrides=tuple(overrides),
        what_if=overall(rec, what),
        what_if_baseline=what_sc.run.baselines[0],
        what_if_records=what,
        what_if_intervals=change_intervals(rec, base, what, jittered=jittered),
        what_if_replays=1 + len(jittered),
        what_if_sessions=sessions_compared(rec, base, what),
    )
