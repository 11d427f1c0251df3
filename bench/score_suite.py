"""Score the detectors on the seeded scenario suite (in memory, plus a few through InfluxDB).

Run: ``.venv/bin/python bench/score_suite.py [--count 228] [--max-ranks 4096] [--influx 3]``
Prints one row per fault kind and the goals (detected with right kind and localisation,
false alarms on clean runs, >=20% slowdowns reported within 3 windows).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time

from stepwatch.detectors import Score, analyse, score, summarise
from stepwatch.detectors.simulation import Scenario, suite


def run_in_memory(scenario: Scenario) -> Score:
    job = scenario.simulate()
    findings = analyse(job.frame())
    return score(
        job.truth,
        [f.diagnosis for f in findings],
        detected_unix_nano={f.diagnosis.finding_id: f.detected_unix_nano for f in findings},
    )


def run_through_influx(scenarios: list[Scenario]) -> list[Score]:
    from stepwatch.app._replay import write_direct
    from stepwatch.core import ManagedInfluxDB
    from stepwatch.detectors import detect_job_findings

    results = []
    with tempfile.TemporaryDirectory() as directory, ManagedInfluxDB(directory) as server:
        client = server.client()
        for scenario in scenarios:
            job = scenario.simulate()
            write_direct(job, client)
            findings = detect_job_findings(
                client,
                job.truth.job,
                start_unix_nano=job.truth.start_unix_nano,
                end_unix_nano=job.truth.end_unix_nano,
            )
            results.append(
                score(
                    job.truth,
                    [f.diagnosis for f in findings],
                    detected_unix_nano={
                        f.diagnosis.finding_id: f.detected_unix_nano for f in findings
                    },
                )
            )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=228)
    parser.add_argument("--max-ranks", type=int, default=4096)
    parser.add_argument("--influx", type=int, default=3, help="scenarios also run via influxd")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    scenarios = suite(args.count, max_world_size=args.max_ranks)
    started = time.perf_counter()
    scores = []
    for scenario in scenarios:
        result = run_in_memory(scenario)
        scores.append(result)
        bad = result.false_alarms or any(not f.localised for f in result.faults)
        if args.verbose or bad:
            for item in result.faults:
                if not item.localised:
                    got = item.diagnosis
                    seen = (
                        None
                        if got is None
                        else (got.kind, got.ranks[:6], got.hosts, got.kernel_class)
                    )
                    print(
                        f"  MISS {scenario.name}: {item.fault.kind} ranks={item.fault.ranks[:6]} "
                        f"hosts={item.fault.hosts} kernel={item.fault.kernel_class} -> {seen}"
                    )
            for alarm in result.false_alarms:
                print(f"  FALSE ALARM {scenario.name}: {alarm.kind} {alarm.summary}")
    elapsed = time.perf_counter() - started
    by_kind: dict[str, list] = collections.defaultdict(list)
    for result in scores:
        for item in result.faults:
            by_kind[item.fault.kind].append(item)
    print(
        f"{'kind':<18} {'n':>4} {'detected':>9} {'kind ok':>8} {'localised':>9} "
        f"{'lat<=3 (>=20%)':>15}"
    )
    for kind, items in sorted(by_kind.items()):
        big = [i for i in items if i.fault.severity >= 1.2 and kind != "rank_missing"]
        fast = sum(i.latency_windows is not None and i.latency_windows <= 3 for i in big)
        print(
            f"{kind:<18} {len(items):>4} {sum(i.detected for i in items):>9} "
            f"{sum(i.right_kind for i in items):>8} {sum(i.localised for i in items):>9} "
            f"{f'{fast}/{len(big)}':>15}"
        )
    total = summarise(scores)
    print(
        f"\nscenarios {total.scenarios} ({total.clean_runs} clean) in {elapsed:.1f} s in memory\n"
        f"detected with right kind and localisation: {total.localised}/{total.faults} "
        f"= {100 * total.localised / max(total.faults, 1):.1f}% (goal >= 99%)\n"
        f"detected at all: {total.detected}/{total.faults}; right kind: {total.right_kind}\n"
        f"false alarms on clean runs: {total.false_alarms_clean} (goal 0); "
        f"on faulty runs (unrelated findings): {total.false_alarms_faulty}\n"
        f">=20% slowdowns reported within 3 windows: {total.big_within_3}/{total.big_faults} "
        f"= {100 * total.big_within_3 / max(total.big_faults, 1):.1f}% (goal: all)"
    )
    if args.influx:
        picked = [s for s in scenarios if s.world_size <= 32][: args.influx]
        started = time.perf_counter()
        influx_scores = run_through_influx(picked)
        ok = sum(f.localised for s in influx_scores for f in s.faults)
        n = sum(len(s.faults) for s in influx_scores)
        alarms = sum(len(s.false_alarms) for s in influx_scores)
        print(
            f"through influxd (WindowBuilder -> convert_request -> InfluxDB -> InfluxQL reader): "
            f"{ok}/{n} localised, {alarms} false alarms, {len(picked)} scenarios in "
            f"{time.perf_counter() - started:.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
